"""Shared fixtures: tiny random-weight HF models written with save_pretrained."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's CPU interpreter, set before any test module (or what it imports) imports Triton: a kernel module
    # imported without it makes compiled-mode helpers that an interpreted kernel cannot call, whatever the order
    # of the test files pytest is given
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def make_tiny_model(path: Path, arch: str, **overrides) -> Path:
    """Save a tiny random model of `arch` with transformers, so our loader reads real files."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[arch]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # larger-than-default weights so that mistakes show up in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from nanovllm.models.fetch import fetch_model

    return fetch_model("smollm2-135m", progress=False)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # a case parametrised on the CUDA device is a `cuda` case: `-m cuda` selects it too
        params = getattr(item, "callspec", None)
        if params is not None and any(str(value) == "cuda" for value in params.params.values()):
            item.add_marker(pytest.mark.cuda)
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
