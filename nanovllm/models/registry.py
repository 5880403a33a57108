"""Model registry keyed by the `architectures` entry of config.json."""
from __future__ import annotations

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


def register_model(architecture: str):
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        _MODELS[architecture] = cls
        return cls

    return wrap


def model_class_for(hf_config: dict) -> type[nn.Module]:
    _import_builtin_models()
    for arch in hf_config.get("architectures", []):
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported architectures {hf_config.get('architectures')}; supported: {sorted(_MODELS)}"
    )


def _import_builtin_models() -> None:
    from nanovllm.models import llama, qwen2, qwen3  # noqa: F401  (registration side effect)
