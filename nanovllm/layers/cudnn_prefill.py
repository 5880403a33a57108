"""Dense prefill of one long chunk through torch's cuDNN attention, the triton backend's route on Hopper.

On the H200 (Llama-3.1-8B shape, an 8K chunk, bf16) cuDNN's fused attention runs at 610-665 TFLOP/s where
our Triton prefill kernel reaches 390-470, and attention was 647 of a 32K prefill's 1,362 ms. cuDNN needs
contiguous keys, so the sequence's blocks are gathered (one copy of its K and V, ~1% of the attention's
time) and, since its causal mask is aligned top-left, a chunk with a cached prefix takes two calls: the
chunk over the prefix (no mask) and over itself (causal), merged by log-sum-exp. GQA goes to cuDNN as is
(K/V not repeated over the query heads).

The route serves steps of one sequence with at least MIN_QUERY_TOKENS new tokens whose gathered K and V fit
in MAX_GATHER_BYTES; everything else (batches, decode rows, per-KV-head tables of sparse policies, the
offload paths that pass their own output buffers) stays on the Triton kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.layers.attention import AttentionMetadata

MIN_QUERY_TOKENS = 1024
MAX_GATHER_BYTES = 1 << 30  # a temporary copy of the sequence's K and V per layer (128K tokens at 8 x 128 bf16: 0.5 GiB)


def cudnn_attention_available(device: torch.device) -> bool:
    """torch's cuDNN attention is there and enabled, on a Hopper-or-newer GPU (where it was measured)."""
    return (device.type == "cuda" and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(device) >= (9, 0))


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Caches of this dtype and head_dim on this device can take the route."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 128 \
        and cudnn_attention_available(device)


def takes_cudnn_route(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this prefill step goes to cuDNN (a host-side decision over shapes, made once per step)."""
    head_dim, num_kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    return (meta.num_seqs == 1 and meta.query_lens[0] >= MIN_QUERY_TOKENS and q.shape[0] == meta.query_lens[0]
            and k_cache.dtype == q.dtype and meta.block_tables_tensor.dim() == 2 and k_cache.is_contiguous()
            and 2 * meta.seq_lens[0] * num_kv_heads * head_dim * k_cache.element_size() <= MAX_GATHER_BYTES
            and supports(q.dtype, head_dim, q.device))


def padded_rows(tokens: int) -> int:
    """The query rows a chunk of `tokens` is padded to: at most 1/8 more, so few shapes per octave (cuDNN
    plans each new shape on its first call, on the request path unless `warm_up` saw it)."""
    grain = max(256, 1 << max(0, tokens.bit_length() - 4))
    return -(-tokens // grain) * grain


def cudnn_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D], lse [T, Hq] float32) of the step's one sequence: its T new tokens (K/V already
    stored) over its cached prefix and themselves, causal. The chunk's queries and keys are padded with
    zero rows to `padded_rows(T)`: under the causal mask (top-left aligned) no real row sees a padded key."""
    seq_len, chunk = meta.seq_lens[0], meta.query_lens[0]
    prefix, rows = seq_len - chunk, padded_rows(chunk)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    blocks = meta.block_tables_tensor[0, : -(-seq_len // block_size)]
    keys = k_cache[blocks].view(-1, num_kv_heads, head_dim)  # token-major copies of the sequence's blocks
    values = v_cache[blocks].view(-1, num_kv_heads, head_dim)
    queries = _pad_rows(q, rows).contiguous()  # the strides warm_up planned for
    out, lse = _cudnn(queries, _pad_rows(keys[prefix:seq_len], rows), _pad_rows(values[prefix:seq_len], rows),
                      scale, causal=True)
    if prefix:
        from nanovllm.kernels.triton_merge import merge_two_states

        history, history_lse = _cudnn(queries, keys[:prefix], values[:prefix], scale, causal=False)
        return merge_two_states(history[:chunk], history_lse[:chunk], out[:chunk], lse[:chunk])
    return out[:chunk], lse[:chunk]


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
            max_tokens: int) -> int:
    """Plan cuDNN's causal attention for every padded chunk size up to max_tokens (a prefix-free prefill
    of any length then finds its plan); returns how many shapes."""
    shapes = sorted({padded_rows(n) for n in range(MIN_QUERY_TOKENS, max_tokens + 1)})
    for rows in shapes:
        q = torch.zeros(rows, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device)
        _cudnn(q, kv, kv, head_dim ** -0.5, causal=True)
    return len(shapes)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D], lse [T, Hq] float32 view) of cuDNN attention on token-major q [T, Hq, D] and
    k/v [L, Hk, D] (GQA as is; cuDNN takes the [1, H, L, D] views' strides as they are and writes out
    token-major)."""
    as_heads = lambda x: x[None].transpose(1, 2)  # noqa: E731
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(as_heads(q), as_heads(k), as_heads(v), None, True,
                                                                   0.0, causal, False, scale=scale)[:2]
    return out[0].transpose(0, 1), lse.view(lse.shape[1], lse.shape[2]).t()
