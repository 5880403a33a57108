"""LlamaForCausalLM, and the decoder that the Qwen2 and Qwen3 variants reuse.

Module names mirror the HF checkpoints so weights load by name. Tokens of all sequences in a step
are flattened into one [num_tokens, hidden] batch; attention metadata says where each one starts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.distributed.layers import embedding, lm_head, row_parallel_linear
from nanovllm.distributed.parallel_state import SINGLE, TensorParallel
from nanovllm.distributed.sharding import Placement, local_config, shard
from nanovllm.layers.fused_ops import LayerOps
from nanovllm.layers.kv_access import KVAccess
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.models.registry import register_model


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, c: dict, **variant) -> "DecoderConfig":
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")
        num_heads = c["num_attention_heads"]
        num_kv_heads = c.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        rope = c.get("rope_parameters") or {}
        scaling = rope if rope.get("rope_type", "default") != "default" else c.get("rope_scaling")
        fields = dict(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=c.get("attention_bias", False),
            mlp_bias=c.get("mlp_bias", False),
        )
        fields.update(variant)
        return cls(**fields)


class Attention(nn.Module):
    """cfg: this rank's heads (all of them with one rank)."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one GEMM; the checkpoint's q_proj/k_proj/v_proj load into its row ranges.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = row_parallel_linear(self.q_size, cfg.hidden_size, False, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = cfg.qk_norm
        self.eps = cfg.rms_norm_eps
        self.ops = ops
        self.scale = cfg.head_dim**-0.5

    def forward(self, rope, x: torch.Tensor, kv: KVAccess) -> torch.Tensor:
        """x: the normed input of the layer."""
        norm_weights = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        target = kv.write_target(self.layer_idx)
        if target is None:
            q, k, v = self.ops.qkv_rope(x, self.qkv_proj, heads, *rope, *norm_weights, self.eps)
            out = kv.attend(self.layer_idx, q, k, v, self.scale)
        else:  # k and v stored by the op that rotates k (one launch fewer per layer on the GPU)
            q, k, v = self.ops.qkv_rope(x, self.qkv_proj, heads, *rope, *norm_weights, self.eps, store=target)
            out = kv.attend_written(self.layer_idx, q, k, v, self.scale)
        return self.ops.linear(out.flatten(1), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = row_parallel_linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the normed input of the MLP."""
        return self.ops.linear(self.ops.gate_up_silu(x, self.gate_up_proj), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, ops, tp)
        self.mlp = MLP(cfg, ops, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, rope, x, residual, kv: KVAccess) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (residual None: first layer).
        Returns this layer's MLP output and the residual stream before it; the next norm adds them. The q/k/v
        projection's op also applies RoPE (`LayerOps.qkv_rope`), the gate/up projection's SiLU * up
        (`LayerOps.gate_up_silu`)."""
        norm, ops = self.input_layernorm, self.self_attn.ops
        normed, residual = ops.norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(rope, normed, kv)
        norm = self.post_attention_layernorm
        normed, residual = ops.norm(x, residual, norm.weight, norm.eps)
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: LayerOps, tp: TensorParallel):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, input_ids, positions, kv: KVAccess) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, kv)
        return self.norm(x, residual)[0]


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config: dict, ops: LayerOps | None = None, tp: TensorParallel = SINGLE):
        """tp: this process's rank; `config` then holds the rank's own head and MLP counts."""
        super().__init__()
        self.full_config = self.parse_config(hf_config)
        self.config = cfg = local_config(self.full_config, tp)
        self.tp = tp
        self.model = DecoderModel(cfg, ops or LayerOps(), tp)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head (again after materialising from the meta device)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def parse_config(hf_config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config)

    def forward(self, input_ids, positions, kv: KVAccess) -> torch.Tensor:
        """input_ids, positions: [T] tokens of every sequence in the step; kv: the step's KV access."""
        return self.model(input_ids, positions, kv)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype, as HF's lm_head gives them; whoever needs float32 casts (exactly):
        the Triton sampler reads 16-bit logits as they are, sparing a [B, V] float32 copy a decode step."""
        return self.lm_head(hidden)

    def checkpoint_target(self, name: str) -> Placement:
        """Where a checkpoint tensor goes: the parameter, its first row, and with tensor parallelism the
        slice this rank keeps. Separate HF projections land in row ranges of the packed qkv_proj and
        gate_up_proj parameters."""
        if name.count(".") < 2:
            return self._placement(name, name.split(".")[0], name.rsplit(".", 1)[-1], 0)
        prefix, module, leaf = name.rsplit(".", 2)
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", inter)}
        if module not in packed:
            return self._placement(name, module, leaf, 0)
        target, row = packed[module]
        return self._placement(f"{prefix}.{target}.{leaf}", module, leaf, row)

    def _placement(self, param: str, module: str, leaf: str, row: int) -> Placement:
        if self.tp.size == 1:
            return Placement(param, row)
        return Placement(param, row, *shard(module, leaf, self.full_config, self.tp))

    def checkpoint_pieces(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A parameter of the one-rank model as the checkpoint tensors it is loaded from (packed ones split)."""
        if name.count(".") < 2:
            return [(name, tensor)]
        prefix, module, leaf = name.rsplit(".", 2)
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if module == "qkv_proj":
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]))
        elif module == "gate_up_proj":
            parts = zip(("gate_proj", "up_proj"), tensor.split([c.intermediate_size] * 2))
        else:
            return [(name, tensor)]
        return [(f"{prefix}.{m}.{leaf}", t) for m, t in parts]

    def ignored_checkpoint_keys(self) -> set[str]:
        """Checkpoint tensors that are fine to skip (a tied head stored anyway)."""
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()
