"""Build a model from an HF-format directory, streaming weights tensor by tensor from safetensors."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.fused_ops import LayerOps
from nanovllm.models.registry import model_class_for


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time; only one tensor is materialised at once."""
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    ignored = model.ignored_checkpoint_keys()
    rows_loaded: dict[str, int] = {}
    for name, tensor in iter_checkpoint(model_dir):
        target, row = model.checkpoint_target(name)
        if target not in params:
            if name in ignored or name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        param = params[target]
        fits = tensor.dim() > 0 and row + tensor.shape[0] <= param.shape[0]
        dest = param.narrow(0, row, tensor.shape[0]) if fits else param
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit {target} "
                             f"{tuple(param.shape)} at row {row}")
        with torch.no_grad():
            dest.copy_(tensor)
        rows_loaded[target] = rows_loaded.get(target, 0) + tensor.shape[0]
    missing = sorted(n for n, p in params.items() if rows_loaded.get(n, 0) != p.shape[0])
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def build_model(
    hf_config: dict, dtype: torch.dtype, device: torch.device, model_dir: Path | None,
    seed: int = 0, ops: LayerOps | None = None,
) -> nn.Module:
    """Create the model without initialising weights, then load them (or randomise from seed when model_dir is None)."""
    cls = model_class_for(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, ops)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    if model_dir is None:
        init_random_weights(model, torch.Generator(device).manual_seed(seed))
    else:
        load_weights(model, model_dir)
    return model.eval()


def init_random_weights(model: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Random weights for benchmarks of model shapes (norms at 1 so activations stay bounded); the same
    generator seed gives the same weights, so two engines in one benchmark run the same model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
