"""Batch-1 decode attention at 1K (Llama-3.1-8B shape) in a layer-like chain of dependent launches, 32 layers in one
CUDA graph: qkv GEMV -> attention (decode + merge) -> o GEMV. The decode kernel as it was (old_paged_attention.py)
against this tree's (lengths and tables read, first tiles prefetched into L2 before the wait), at 1 and 2 stages."""
import sys

import torch

import old_paged_attention as old_ops
from nanovllm.kernels import triton_paged_attention as new_ops
from nanovllm.kernels.triton_gemv import gemv


def graph_us(fn, layers):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / 20 / layers


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

        def chain(ops, stages, with_gemv=True, qkv_prefetch=0, o_prefetch=0):
            def fn():
                for i in range(L):
                    q = gemv(x, qkv_w[i], pdl=True, prefetch_k=qkv_prefetch)[:, : Hq * D].view(1, Hq, D) \
                        if with_gemv else x[:, : Hq * D].view(1, Hq, D)
                    a = ops.paged_decode_attention(q, kc[i], vc[i], cu, lens, tables, D**-0.5, pdl=True,
                                                   num_stages=stages)[0]
                    if with_gemv:
                        gemv(a.view(1, -1), o_w[i], pdl=True, prefetch_k=o_prefetch)
            return fn

        q0 = x[:, : Hq * D].view(1, Hq, D).contiguous()
        want = old_ops.paged_decode_attention(q0, kc[0], vc[0], cu, lens, tables, D**-0.5)[0]
        got = new_ops.paged_decode_attention(q0, kc[0], vc[0], cu, lens, tables, D**-0.5, pdl=True)[0]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
        ref = torch.nn.functional.linear(x.float(), o_w[0].float())
        torch.testing.assert_close(gemv(x, o_w[0], pdl=True, prefetch_k=2048).float(), ref, atol=2e-2, rtol=2e-2)
        for rep in range(2):
            for name, ops in (("old", old_ops), ("new", new_ops)):
                for stages in (1, 2):
                    us = graph_us(chain(ops, stages), L)
                    alone = graph_us(chain(ops, stages, with_gemv=False), L)
                    print(f"{ctx:6d} rep {rep} {name} stages {stages}: qkv+attn+o {us:7.2f} us/layer; "
                          f"attn alone {alone:6.2f}", flush=True)
            for qkv_p, o_p in ((0, 1024), (0, 2048), (0, 4096), (1024, 2048), (2048, 2048), (4096, 4096)):
                us = graph_us(chain(new_ops, 1, qkv_prefetch=qkv_p, o_prefetch=o_p), L)
                print(f"{ctx:6d} rep {rep} new stages 1, GEMV prefetch qkv {qkv_p} o {o_p}: qkv+attn+o {us:7.2f} "
                      f"us/layer", flush=True)

if __name__ == "__main__":
    sys.exit(main())
