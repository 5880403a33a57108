"""nanovllm: a compact LLM inference engine for long contexts on limited GPU memory."""
import os

# torch makes CUDA load a library's kernels lazily, at their first launch: the first request of a new shape
# then waited 7-21 ms for GEMM kernels nothing compiled (docs/BENCHMARKS.md, "Kernels compiled on the request
# path"). Loaded eagerly, that cost moves to start-up. Read when CUDA initialises: a value set before, kept.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
