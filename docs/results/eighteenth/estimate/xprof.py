"""XAttention select() at 128K (one layer, shaped inputs): kernels by time; the Triton estimate's launch options."""
import sys, time, torch
sys.path.insert(0, "bench")
from sparse import shaped_inputs, sparse_batch, KV_HEADS, BLOCK
from common import cuda_ms
from nanovllm.engine.kv_cache import PagedKVCache
from nanovllm.layers.attention import get_attention_backend
from nanovllm.layers.sparse_policies import XAttentionSelector, antidiagonal_mass
from nanovllm.kernels import triton_xattention as tx
context = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
q, k, v = shaped_inputs(context, seed=context)
blocks = -(-context // BLOCK)
cache = PagedKVCache(1, blocks, BLOCK, KV_HEADS, 128, torch.bfloat16, torch.device("cuda"))
backend = get_attention_backend("triton")
table = torch.randperm(blocks).tolist()
slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)]
meta = backend.build_metadata([context], [context], [table], slots, BLOCK, torch.device("cuda"))
cache.write(0, k, v, torch.tensor(slots, device="cuda"))
sel = XAttentionSelector(cache, None, 0.9, 16, 128, min_context=0, cover="head")
batch = sparse_batch(meta)
print(f"select {cuda_ms(lambda: sel.select(0, q, KV_HEADS, batch), 3):.1f} ms")
print(f"granule_mass {cuda_ms(lambda: sel.granule_mass(q, k, 128), 3):.1f} ms")
print(f"antidiagonal_mass one 8K chunk at the end {cuda_ms(lambda: antidiagonal_mass(q[-8192:], k, 16, True), 3):.2f} ms")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    sel.select(0, q, KV_HEADS, batch); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
