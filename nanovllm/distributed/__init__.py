"""Tensor parallelism: ranks and collectives (`parallel_state`), parallel layers (`layers`), how checkpoint
tensors are cut per rank (`sharding`), and the worker processes that execute one plan per step (`executor`)."""
