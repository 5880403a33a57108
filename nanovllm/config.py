"""Engine configuration: one frozen, validated dataclass built from LLM(...) options."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")
SPARSE_POLICIES = ("full", "xattention", "quest", "xattention+quest")
XATTN_COVERS = ("group", "head")
QUEST_RERANK_SCORES = ("max", "mass")
QUEST_KEY_COPY_BITS = {"int8": 8, "int4": 4}  # quest_key_copy -> bits per code of the copy
QUEST_HOST_KEYS = ("host", "copy")
QUEST_KEY_COPIES = ("none", *QUEST_KEY_COPY_BITS)
_DEVICES = ("auto", "cuda", "cpu")
GENERATION_CONFIGS = ("auto", "vllm")
NOT_OPTIONS = ("model", "model_path", "hf_config")


def check_shareable(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """KV heads are split over the ranks (unevenly where they do not divide: the first ranks take one more, each
    with its query heads), or, fewer than the ranks, replicated: then the query heads must split evenly."""
    if num_kv_heads < size and (size % num_kv_heads or num_heads % size):
        raise ValueError(f"tensor_parallel_size={size} exceeds num_key_value_heads={num_kv_heads}: it must then be a "
                         f"multiple of them and divide num_attention_heads={num_heads} (each KV head replicated)")
    if intermediate_size < size:
        raise ValueError(f"tensor_parallel_size={size} exceeds intermediate_size={intermediate_size}")


@dataclass(frozen=True)
class EngineConfig:
    """All engine options. Unknown keys raise TypeError; bad values raise ValueError."""

    model: str  # as given: a directory, a default model's name or a Hugging Face Hub id (models/hub.py)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kvcache_block_size: int = 256
    num_gpu_blocks: int | None = None  # the device's KV pool; None: sized from gpu_memory_utilization (CPU device: cpu_kv_cache_gb)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0  # KV in host RAM (all ranks together): the offload pool (pinned), or the whole pool on a CPU device
    enable_cpu_offload: bool = False  # blocks beyond the device pool live in host memory and are streamed back
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_scheduling: bool = False  # launch step N+1 before step N's tokens reach the host (see LLMEngine)
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"  # "torch" (reference, any device), "triton" (CUDA), "auto"
    load_format: str = "auto"  # "dummy": random weights of the config's shape (benchmarks)
    sparse_policy: str = "full"  # block-sparse attention: "xattention" (prefill), "quest" (decode), both, or "full"
    xattn_threshold: float = 0.9  # XAttention keeps, per KV head, the fewest blocks covering this estimated mass
    xattn_stride: int = 16  # antidiagonal stride of XAttention's estimate
    xattn_block_size: int = 128  # XAttention's query/key block in tokens
    xattn_cover: str = "head"  # "head": each query head's own mass covers the threshold, the KV head keeps the
    # union (RULER on the H200: within 1 point of full, "group" 3.5-3.8 below); "group": their summed mass does
    # XAttention: the prompt's last N query blocks (the question, the answer prefix) attend to every key block;
    # 2 measured on RULER (docs/BENCHMARKS.md, thirteenth session): -1.5 -> +1.2 points at 4K, -1.5 -> -0.3 at 8K
    xattn_dense_last_blocks: int = 2
    xattn_local_blocks: int = 0  # XAttention: each query block keeps the N key blocks before its own (local window)
    quest_token_budget: int = 2048  # Quest: KV tokens each KV head reads per decode step, besides sink and recent
    quest_dense_layers: int = 2  # Quest: the first layers stay dense
    quest_page_select: bool = True  # Quest: decode steps keep each KV head's top 16-token pages, not blocks
    # Quest with quest_key_copy="none": the bound's top quest_rerank x budget pages (blocks) are ranked again by their
    # keys' exact largest score (1: the bound alone, as the paper; 2 lost 4.3 RULER points at Qwen 32K where the bound
    # lost 6, 0.6-1.4 on SmolLM2); a key copy scores every page exactly and has nothing to rerank
    quest_rerank: int = 2
    # Quest: how the rerank ranks its candidates: "max", a page's largest q . k over the group's query heads; "mass",
    # each query head's softmax mass on the page among the candidates, sink and recent pages, the group's maximum
    quest_rerank_score: str = "max"
    # Quest: "int8": an int8 copy of every key (a scale per token and KV head; 0.52x the bf16 keys' bytes, on the
    # device for host blocks too) scores each page exactly (its largest q . k): no bound, no rerank, no host key read;
    # within 2 RULER points of full where the bound + rerank lost 4.3 (Qwen 32K). "int4": the same at half the
    # memory (0.27x the keys' bytes; 2 points less than int8 on Qwen 32K's hardest tasks). "none": the bound and
    # the rerank, no copy (its device memory goes to the KV pool)
    quest_key_copy: str = "int8"
    # Quest in offload mode: where a decode step's kept host pages' keys come from. "host": from pinned host memory
    # with their values (the keys as stored). "copy": from the device's int8 key copy (needs quest_key_copy="int8"),
    # so only values cross PCIe: half the host bytes, the keys of host pages rounded to 8 bits (decode steps and the
    # decode rows of mixed steps; device pages and prefill keep their own keys)
    quest_host_keys: str = "host"
    sparse_min_context: int = 8192  # sequences shorter than this run dense (0: always sparse)
    revision: str | None = None  # a Hub model's branch, tag or commit (default: main)
    download_dir: str | None = None  # the hub cache to download Hub models into (default: huggingface_hub's)
    generation_config: str = "auto"  # "auto": sampling defaults from the model's generation_config.json; "vllm": none
    model_path: str = field(default="", repr=False)  # the local directory the model resolved to
    hf_config: dict = field(default_factory=dict, repr=False)  # filled from config.json

    @classmethod
    def from_options(cls, model: str, model_path: str | None = None, **options: Any) -> "EngineConfig":
        """model_path: the directory `model` resolved to (models/hub.py), when it is not that directory."""
        known = {f.name for f in dataclasses.fields(cls)} - set(NOT_OPTIONS)
        for key in options:
            if key not in known:
                raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(sorted(known))}")
        path = model_path or model
        return cls(model=model, model_path=path, hf_config=load_hf_config(path), **options)

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("kvcache_block_size", self.kvcache_block_size)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size must be a multiple of 16, got {self.kvcache_block_size}")
        if self.num_gpu_blocks is not None:
            _positive_int("num_gpu_blocks", self.num_gpu_blocks)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.cpu_kv_cache_gb > 0:
            raise ValueError(f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}")
        self._check_tensor_parallel()
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        self._check_sparse_options()
        for name in ("revision", "download_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        if not self.model_path:
            object.__setattr__(self, "model_path", self.model)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        model_limit = self.model_max_position
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", model_limit)
        else:
            _positive_int("max_model_len", self.max_model_len)
            if model_limit is not None and self.max_model_len > model_limit:
                raise ValueError(
                    f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={model_limit}"
                )
        if self.max_model_len is None:
            raise ValueError("max_model_len is required: the model config has no max_position_embeddings")

    def _check_tensor_parallel(self) -> None:
        """Heads and MLP columns split over the ranks (distributed/sharding.py: KV heads split, unevenly where they
        do not divide, or replicated when fewer)."""
        n, c = self.tensor_parallel_size, self.hf_config
        if n == 1 or not c:
            return
        heads = c.get("num_attention_heads", 1)
        check_shareable(heads, c.get("num_key_value_heads") or heads, c.get("intermediate_size", n), n)

    def _check_sparse_options(self) -> None:
        if self.sparse_policy not in SPARSE_POLICIES:
            raise ValueError(f"sparse_policy must be one of {SPARSE_POLICIES}, got {self.sparse_policy!r}")
        if not isinstance(self.xattn_threshold, (int, float)) or isinstance(self.xattn_threshold, bool) \
                or not 0.0 < self.xattn_threshold <= 1.0:
            raise ValueError(f"xattn_threshold must be in (0, 1], got {self.xattn_threshold!r}")
        if self.xattn_cover not in XATTN_COVERS:
            raise ValueError(f"xattn_cover must be one of {XATTN_COVERS}, got {self.xattn_cover!r}")
        _positive_int("xattn_block_size", self.xattn_block_size)
        _positive_int("xattn_stride", self.xattn_stride)
        if self.xattn_block_size % 16:
            raise ValueError(f"xattn_block_size must be a multiple of 16, got {self.xattn_block_size}")
        if self.xattn_block_size % self.xattn_stride:
            raise ValueError(f"xattn_stride={self.xattn_stride} must divide xattn_block_size={self.xattn_block_size}")
        if self.kvcache_block_size % self.xattn_block_size and self.xattn_block_size % self.kvcache_block_size:
            raise ValueError(f"xattn_block_size={self.xattn_block_size} and kvcache_block_size="
                             f"{self.kvcache_block_size} must divide one another")
        _positive_int("quest_token_budget", self.quest_token_budget)
        _positive_int("quest_rerank", self.quest_rerank)
        if self.quest_rerank_score not in QUEST_RERANK_SCORES:
            raise ValueError(f"quest_rerank_score must be one of {QUEST_RERANK_SCORES}, "
                             f"got {self.quest_rerank_score!r}")
        if self.quest_key_copy not in QUEST_KEY_COPIES:
            raise ValueError(f"quest_key_copy must be one of {QUEST_KEY_COPIES}, got {self.quest_key_copy!r}")
        if self.quest_host_keys not in QUEST_HOST_KEYS:
            raise ValueError(f"quest_host_keys must be one of {QUEST_HOST_KEYS}, got {self.quest_host_keys!r}")
        if self.quest_host_keys == "copy" and self.quest_key_copy != "int8":
            raise ValueError(f"quest_host_keys='copy' reads host pages' keys from the int8 key copy: it needs "
                             f"quest_key_copy='int8', got {self.quest_key_copy!r}")
        if not isinstance(self.quest_page_select, bool):
            raise ValueError(f"quest_page_select must be a bool, got {self.quest_page_select!r}")
        for name in ("xattn_dense_last_blocks", "xattn_local_blocks", "quest_dense_layers", "sparse_min_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def model_max_position(self) -> int | None:
        return self.hf_config.get("max_position_embeddings")

    @property
    def num_blocks_per_seq_limit(self) -> int:
        return -(-self.max_model_len // self.kvcache_block_size)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def load_hf_config(model: str) -> dict:
    """Read and sanity-check <model>/config.json, with errors that name the file and the problem."""
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a model directory needs config.json")
    config = read_json_object(config_file)
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{config_file} has no 'architectures' list")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise ValueError(f"{config_file}: {key!r} must be a positive integer, got {config.get(key)!r}")
    return config


def read_json_object(path: Path) -> dict:
    """A JSON file holding one object; ValueError naming the file otherwise."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config
