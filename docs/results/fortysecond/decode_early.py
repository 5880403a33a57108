"""Batch-1 decode attention at 1K (Llama-3.1-8B shape) in a layer-like chain of dependent launches, 32 layers in one
CUDA graph: qkv GEMV -> attention (decode + merge) -> o GEMV. The decode kernel as it was (the tree at 2ab60ee,
carried as .models/old42, or OLD_TREE) against this tree's (lengths and tables read, short splits prefetched into L2
before the wait), at 1 and 2 stages. (h100_decode_early.log also has rows of a GEMV prefetching its weights into L2
before its wait, an option since removed: no gain at 1K, slower at 32K.)
Run from the repository root: PYTHONPATH=. python3 docs/results/fortysecond/decode_early.py"""
import importlib.util
import os
import sys

import torch

from nanovllm.kernels import triton_paged_attention as new_ops
from nanovllm.kernels.triton_gemv import gemv
from probe_common import graph_us

_old = os.path.join(os.environ.get("OLD_TREE", ".models/old42"), "nanovllm/kernels/triton_paged_attention.py")
_spec = importlib.util.spec_from_file_location("old_paged_attention", _old)
old_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old_ops)


def main():
    torch.manual_seed(0)
    dev = "cuda"
    L, H, Hq, Hk, D, B = 32, 4096, 32, 8, 128, 256
    width = (32768 + 64 + 16 + B - 1) // B
    qkv_w = [torch.randn(6144, H, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    o_w = [torch.randn(H, H, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    x = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    print(torch.cuda.get_device_name(), flush=True)
    for ctx in (1024, 32768):
        nblk = -(-ctx // B)
        kc = [torch.randn(nblk, B, Hk, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
        vc = [torch.randn_like(k) for k in kc]
        cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        tables = torch.zeros(1, width, dtype=torch.int64, device=dev)
        tables[0, :nblk] = torch.randperm(nblk, device=dev)

        def chain(ops, stages, with_gemv=True):
            def fn():
                for i in range(L):
                    q = gemv(x, qkv_w[i], pdl=True)[:, : Hq * D].view(1, Hq, D) \
                        if with_gemv else x[:, : Hq * D].view(1, Hq, D)
                    a = ops.paged_decode_attention(q, kc[i], vc[i], cu, lens, tables, D**-0.5, pdl=True,
                                                   num_stages=stages)[0]
                    if with_gemv:
                        gemv(a.view(1, -1), o_w[i], pdl=True)
            return fn

        q0 = x[:, : Hq * D].view(1, Hq, D).contiguous()
        want = old_ops.paged_decode_attention(q0, kc[0], vc[0], cu, lens, tables, D**-0.5)[0]
        got = new_ops.paged_decode_attention(q0, kc[0], vc[0], cu, lens, tables, D**-0.5, pdl=True)[0]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        for rep in range(2):
            for name, ops in (("old", old_ops), ("new", new_ops)):
                for stages in (1, 2):
                    us = graph_us(chain(ops, stages), L)
                    alone = graph_us(chain(ops, stages, with_gemv=False), L)
                    print(f"{ctx:6d} rep {rep} {name} stages {stages}: qkv+attn+o {us:7.2f} us/layer; "
                          f"attn alone {alone:6.2f}", flush=True)

if __name__ == "__main__":
    sys.exit(main())
