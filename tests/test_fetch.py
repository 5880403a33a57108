"""Tests for nanovllm.models.fetch (the slow one converts SmolLM2-135M from its GGUF)."""
from __future__ import annotations

import hashlib
import json

import pytest

from nanovllm.models import fetch
from nanovllm.models.fetch import fetch_model, is_complete, verify_sha256


def test_verify_sha256_accepts_matching_digest(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"nanovllm" * 1000)
    verify_sha256(f, hashlib.sha256(f.read_bytes()).hexdigest())


def test_verify_sha256_rejects_wrong_digest(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"not the model")
    actual = hashlib.sha256(b"not the model").hexdigest()
    with pytest.raises(ValueError) as err:
        verify_sha256(f, "0" * 64)
    assert "0" * 64 in str(err.value) and actual in str(err.value)


def test_fetch_rejects_corrupt_gguf_and_leaves_nothing(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"corrupt")
    monkeypatch.setattr(fetch, "_package_dir", lambda *a: pkg)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256 mismatch"):
        fetch_model("smollm2-135m", cache_dir=cache, progress=False)
    assert [p.name for p in cache.iterdir()] == [".smollm2-135m.lock"]


def test_unknown_model_name(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        fetch_model("no-such-model", cache_dir=tmp_path)


def test_complete_directory_is_returned_without_work(tmp_path, monkeypatch):
    out = tmp_path / "smollm2-135m"
    out.mkdir()
    for name in (*fetch.REQUIRED_FILES, fetch.COMPLETE_MARKER):
        (out / name).write_text("{}")
    monkeypatch.setattr(fetch, "_package_dir", lambda *a: pytest.fail("should not locate the package"))
    assert fetch_model("smollm2-135m", cache_dir=tmp_path) == out


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    assert fetch.default_cache_dir() == tmp_path
    monkeypatch.delenv("NANOVLLM_CACHE")
    assert fetch.default_cache_dir().parts[-2:] == (".cache", "nanovllm")


@pytest.mark.slow
def test_smollm2_fetch_and_generate():
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch_model("smollm2-135m")  # NANOVLLM_CACHE if set, else ~/.cache/nanovllm
    assert is_complete(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", ".complete"):
        assert (path / name).is_file(), name

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert ("lm_head.weight" in keys) != config["tie_word_embeddings"]

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template is not None
    assert tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
