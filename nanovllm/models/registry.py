"""Model registry keyed by the `architectures` entry of config.json.

Built-in models are listed in _LAZY (architecture -> module) and imported only when asked for; importing a model
module registers its class through @register_model. Models outside the package call register_model themselves.
"""
from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}
_LAZY: dict[str, str] = {
    "LlamaForCausalLM": "nanovllm.models.llama",
    "Qwen2ForCausalLM": "nanovllm.models.qwen2",
    "Qwen3ForCausalLM": "nanovllm.models.qwen3",
}


def register_model(architecture: str):
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        _MODELS[architecture] = cls
        return cls

    return wrap


def model_class_for(hf_config: dict) -> type[nn.Module]:
    for arch in hf_config.get("architectures", []):
        if arch in _LAZY:
            importlib.import_module(_LAZY[arch])  # registers the class (registration side effect)
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported architectures {hf_config.get('architectures')}; supported: {sorted(set(_MODELS) | set(_LAZY))}"
    )
