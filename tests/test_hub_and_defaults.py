"""Models by Hugging Face Hub id (a hub cache laid out on disk, HF_HUB_OFFLINE=1), and sampling defaults
from the model's generation_config.json (vLLM's --generation-config auto / vllm)."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

from nanovllm import LLM, SamplingParams
from nanovllm.engine.model_files import generation_defaults
from nanovllm.engine_args import add_engine_options, engine_options

COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40
SMALL = dict(kvcache_block_size=16, num_gpu_blocks=16, device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def lay_out_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str, ref: str = "main") -> Path:
    """<cache>/models--org--name/snapshots/<commit>/ with the model's files, and refs/<ref> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub(tmp_path, tiny_llama) -> Path:
    cache = tmp_path / "hub"
    lay_out_hub_cache(cache, "acme/tiny-llama", tiny_llama, COMMIT)
    return cache


def test_hub_id_loads_from_the_hub_cache_offline(hub, tiny_llama, offline):
    llm = LLM("acme/tiny-llama", download_dir=str(hub), **SMALL)
    assert llm.config.model == "acme/tiny-llama"
    assert Path(llm.config.model_path) == hub / "models--acme--tiny-llama" / "snapshots" / COMMIT
    local = LLM(str(tiny_llama), **SMALL)
    prompt = [1, 2, 3, 4]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == \
        local.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids


def test_revision_picks_the_snapshot(hub, tiny_llama, offline):
    other = lay_out_hub_cache(hub, "acme/tiny-llama", tiny_llama, OTHER_COMMIT, ref="v2")
    assert Path(LLM("acme/tiny-llama", download_dir=str(hub), revision="v2", **SMALL).config.model_path) == other
    assert Path(LLM("acme/tiny-llama", download_dir=str(hub), revision=OTHER_COMMIT, **SMALL).config.model_path) == other
    with pytest.raises(FileNotFoundError, match="'acme/tiny-llama' at revision 'v3' is not a local directory, and "
                                                "HF_HUB_OFFLINE is set"):
        LLM("acme/tiny-llama", download_dir=str(hub), revision="v3", **SMALL)


def test_default_hub_cache_is_huggingface_hubs(hub, offline, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    assert LLM("acme/tiny-llama", **SMALL).config.model_path.startswith(str(hub))


def test_missing_from_the_cache_offline_is_a_clear_error(hub, offline):
    with pytest.raises(FileNotFoundError, match=f"model 'acme/other' is not a local directory, and HF_HUB_OFFLINE is "
                                                f"set but the hub cache {hub} holds no snapshot of it"):
        LLM("acme/other", download_dir=str(hub), **SMALL)


def test_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(FileNotFoundError, match="model 'acme/tiny-llama' is not a local directory and the Hugging Face "
                                                "Hub cannot be reached .*check the network, or set HF_HUB_OFFLINE=1"):
        LLM("acme/tiny-llama", download_dir=str(tmp_path / "empty"), **SMALL)


def test_download_asks_for_weights_config_and_tokenizer_files_only(tmp_path, tiny_llama, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tiny_llama)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    LLM("acme/tiny-llama", revision="main", download_dir=str(tmp_path), **SMALL)
    repo_id, kwargs = calls[0]
    assert repo_id == "acme/tiny-llama" and kwargs["revision"] == "main" and kwargs["cache_dir"] == str(tmp_path)
    assert kwargs["local_files_only"] is False
    patterns = kwargs["allow_patterns"]
    assert "*.safetensors" in patterns and "*.json" in patterns and "tokenizer.model" in patterns
    assert not any(p.endswith((".bin", ".pt", ".gguf", ".h5", "*")) and p != "*.safetensors" for p in patterns)


def test_paths_that_are_not_hub_ids_keep_the_directory_error(tmp_path):
    for model in (str(tmp_path / "nope"), "./nope/x", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            LLM(model)


def test_hub_options_are_command_line_flags():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--revision", "v2", "--download-dir", "/d", "--generation-config", "vllm"])
    assert engine_options(args) == {"revision": "v2", "download_dir": "/d", "generation_config": "vllm"}


# ---- generation_config.json sampling defaults ------------------------------------------------


@pytest.fixture
def model_with_defaults(tmp_path, tiny_llama) -> Path:
    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.4, "max_new_tokens": 7,
         "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}))
    return path


def test_generation_config_auto_gives_the_default_sampling_params(model_with_defaults):
    llm = LLM(str(model_with_defaults), **SMALL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty, defaults.max_tokens) == \
        (0.0, 5, 0.9, 1.4, 7)
    got = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    explicit = SamplingParams(temperature=0.0, top_k=5, top_p=0.9, repetition_penalty=1.4, max_tokens=7)
    assert got.token_ids == llm.generate([[1, 2, 3]], explicit, use_tqdm=False)[0].token_ids
    assert len(got.token_ids) == 7 or got.finish_reason == "stop"
    given = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(given.token_ids) == 3  # explicit params are used as given, as in vLLM


def test_generation_config_vllm_ignores_the_file(model_with_defaults):
    llm = LLM(str(model_with_defaults), generation_config="vllm", **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams() and llm.generation_defaults == {}


def test_bad_generation_config_values(model_with_defaults, tiny_llama):
    with pytest.raises(ValueError, match="generation_config must be one of \\('auto', 'vllm'\\)"):
        LLM(str(tiny_llama), generation_config="hf", **SMALL)
    (model_with_defaults / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in \\(0, 1\\]"):
        LLM(str(model_with_defaults), **SMALL)


def test_generation_config_without_sampling_fields_changes_nothing(tmp_path, tiny_llama):
    """What `nanovllm fetch` writes for SmolLM2 (token ids only): no defaults, the commands stay greedy."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "use_cache": True}))
    assert generation_defaults(tmp_path) == {} and generation_defaults(tiny_llama) == {}


def test_cli_sampling_flags_override_model_defaults(model_with_defaults):
    from nanovllm.cli import build_parser, sampling_params

    llm = LLM(str(model_with_defaults), **SMALL)
    args = build_parser().parse_args(["generate", "--temperature", "0.5"])
    params = sampling_params(args, llm)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 5, 7)
    plain = LLM(str(model_with_defaults), generation_config="vllm", **SMALL)
    params = sampling_params(build_parser().parse_args(["generate"]), plain)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 1.0, 64)
