"""Build a model from an HF-format directory, streaming weights tensor by tensor from safetensors.

With tensor parallelism each rank reads only its slice of each tensor (`safe_open(...).get_slice`), as the
model's `checkpoint_target` places it; random weights (no model directory) are drawn for the whole model,
parameter by parameter in the one-rank order, and cut the same way, so every tensor-parallel size runs the
same random model.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.distributed.parallel_state import SINGLE, TensorParallel
from nanovllm.distributed.sharding import Placement
from nanovllm.layers.fused_ops import LayerOps
from nanovllm.models.registry import model_class_for

Reader = Callable[[Placement], torch.Tensor]  # a checkpoint tensor, or the slice a placement names


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, Reader]]:
    """Yield (name, reader) one tensor at a time; a reader materialises only the slice it is asked for."""
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, partial(_read_safetensors, f, name)


def _read_safetensors(f, name: str, place: Placement) -> torch.Tensor:
    if place.dim is None:
        return f.get_tensor(name)
    piece = f.get_slice(name)
    end = place.start + place.size
    return piece[place.start : end] if place.dim == 0 else piece[:, place.start : end]


def _cut(tensor: torch.Tensor, place: Placement) -> torch.Tensor:
    return tensor if place.dim is None else tensor.narrow(place.dim, place.start, place.size)


def load_weights(model: nn.Module, checkpoint: Iterator[tuple[str, Reader]], source: str) -> None:
    params = dict(model.named_parameters())
    ignored = model.ignored_checkpoint_keys()
    rows_loaded: dict[str, int] = {}
    for name, read in checkpoint:
        place = model.checkpoint_target(name)
        target, row = place.param, place.row
        if target not in params:
            if name in ignored or name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        param = params[target]
        tensor = read(place)
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
        raise ValueError(f"checkpoint in {source} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def build_model(
    hf_config: dict, dtype: torch.dtype, device: torch.device, model_dir: Path | None,
    seed: int = 0, ops: LayerOps | None = None, tp: TensorParallel = SINGLE,
) -> nn.Module:
    """Create the model without initialising weights, then load them (or randomise from seed when model_dir is
    None). tp: this process's rank of the tensor-parallel group; it holds and loads only its shard."""
    cls = model_class_for(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, ops) if tp.size == 1 else cls(hf_config, ops, tp)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    if model_dir is not None:
        load_weights(model, iter_checkpoint(model_dir), str(model_dir))
    elif tp.size == 1:
        init_random_weights(model, torch.Generator(device).manual_seed(seed))
    else:
        load_weights(model, random_checkpoint(cls, hf_config, dtype, device, seed), f"random weights (seed {seed})")
    return model.eval()


def init_random_weights(model: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Random weights for benchmarks of model shapes (norms at 1 so activations stay bounded); the same
    generator seed gives the same weights, so two engines in one benchmark run the same model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            _init_random(name, param, generator, std)


def _init_random(name: str, param: torch.Tensor, generator: torch.Generator, std: float) -> None:
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    elif name.endswith("bias"):
        param.zero_()
    else:
        param.normal_(0.0, std, generator=generator)


def random_checkpoint(cls: type[nn.Module], hf_config: dict, dtype: torch.dtype, device: torch.device, seed: int,
                      std: float = 0.02) -> Iterator[tuple[str, Reader]]:
    """The one-rank model's random weights (as init_random_weights draws them) as checkpoint tensors."""
    with torch.device("meta"):
        full = cls(hf_config)
    generator = torch.Generator(device).manual_seed(seed)
    for name, meta in full.named_parameters():
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        _init_random(name, tensor, generator, std)
        for piece_name, piece in full.checkpoint_pieces(name, tensor):
            yield piece_name, partial(_cut, piece)
