"""Engine options on a command line: `--flag`s mirroring EngineConfig fields, and back to LLM(...) keywords.

Shared by `nanovllm` (cli.py) and the commands that also run on their own (eval, serving bench); it imports only
nanovllm.config, so any of them can import it without importing the others.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from nanovllm.config import NOT_OPTIONS, EngineConfig

_HELP = {
    "sparse_policy": "block-sparse attention: full, xattention (prefill), quest (decode) or xattention+quest",
    "xattn_threshold": "XAttention: per KV head, the fewest blocks covering this share of the estimated mass",
    "xattn_stride": "XAttention: antidiagonal stride of the estimate",
    "xattn_block_size": "XAttention: query/key block in tokens",
    "xattn_cover": "XAttention: head (each query head covers the threshold; the KV head keeps the union; default) "
                   "or group (a KV head's query heads' summed mass covers it)",
    "xattn_dense_last_blocks": "XAttention: the prompt's last N query blocks (of xattn_block_size tokens) attend to "
                               "every key block",
    "xattn_local_blocks": "XAttention: each query block also keeps the N key blocks before its own (a local window)",
    "quest_token_budget": "Quest: KV tokens each KV head reads per decode step, besides the sink and recent blocks",
    "quest_dense_layers": "Quest: the first N layers stay dense",
    "quest_page_select": "Quest: decode steps keep each KV head's top 16-token pages within the budget (plus the "
                         "sink and recent blocks' pages) instead of its top KV blocks (default: on)",
    "quest_rerank": "Quest with --quest-key-copy none: the bound's top N x budget pages are ranked again by their "
                    "keys' exact largest score, and the budget's best of them kept (default 2; 1: the bound alone, "
                    "as the Quest paper)",
    "quest_rerank_score": "Quest: the rerank's ranking: max (a page's largest q.k over the KV head's query heads) or "
                          "mass (each query head's softmax mass on the page among the candidates, sink and recent "
                          "pages; the heads' maximum)",
    "quest_key_copy": "Quest: int8 (default: an int8 copy of every key on the device, 0.52x the bf16 keys' bytes, "
                      "scores every page exactly: no rerank, no host key read), int4 (the same at 0.27x, a little "
                      "less accurate) or none (the bound, then the rerank; the copy's memory goes to the KV pool)",
    "quest_host_keys": "Quest in offload mode: host (default: kept host pages' keys cross PCIe with their values) or "
                       "copy (their keys from the device's int8 key copy: only values cross PCIe, half the bytes)",
    "sparse_min_context": "sequences shorter than this many tokens run dense (0: always sparse)",
    "max_model_len": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "kvcache_block_size": "tokens per KV block (a multiple of 16)",
    "num_gpu_blocks": "device KV pool in blocks (default: from gpu_memory_utilization, or cpu_kv_cache_gb on a CPU)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "cpu_kv_cache_gb": "GiB of host memory for KV (all tensor-parallel ranks together): the pinned offload pool, or the whole pool on a CPU device",
    "enable_cpu_offload": "keep KV blocks beyond the device pool in pinned host memory, streamed back per layer",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes",
    "enforce_eager": "disable CUDA graphs",
    "async_scheduling": "schedule and launch the next step before this step's tokens reach the host",
    "tensor_parallel_size": "ranks per model: one process per GPU (gloo processes on a CPU device)",
    "dtype": "auto, float32, float16 or bfloat16",
    "device": "auto, cuda or cpu",
    "seed": "seed of the engine's sampling generator",
    "attention_backend": "auto, torch (pure PyTorch reference) or triton (CUDA kernels)",
    "load_format": "auto, or dummy for random weights of the config's shape",
    "revision": "a Hugging Face Hub model's branch, tag or commit",
    "download_dir": "hub cache directory for models given by Hub id (default: huggingface_hub's, ~/.cache/huggingface/hub)",
    "generation_config": "auto: sampling defaults from the model's generation_config.json; vllm: ignore it",
}
_ALIASES = {"tensor_parallel_size": ["-tp"]}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name in NOT_OPTIONS:
            continue
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        if str(f.type).startswith("bool"):
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=_HELP.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], str)
            group.add_argument(*flags, type=kind, default=None, help=f"{_HELP.get(f.name, '')} (default: {f.default})")


def engine_options(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and k not in NOT_OPTIONS and v is not None}


def run_command(command, args: argparse.Namespace) -> None:
    """Run a subcommand; a user error (bad option, request or path) prints one line and exits 2."""
    try:
        command(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
