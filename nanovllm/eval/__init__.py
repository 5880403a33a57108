"""Evaluation harnesses that run over the nanovllm engine (see nanovllm.eval.ruler)."""
