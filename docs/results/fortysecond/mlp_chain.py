"""Batch-1 MLP of the Llama-3.1-8B shape in a chain of dependent launches, 32 layers' weights in one CUDA graph: the
residual add + RMSNorm, the gate/up projection, SiLU * up, the down projection (GEMV). As the engine runs it (gate/up
through cuBLAS, then the SiLU kernel) against gate/up through the GEMV with SiLU in its epilogue (gemv_silu)."""
import sys

import torch
import torch.nn.functional as F

from nanovllm.kernels import triton_fused
from nanovllm.kernels.triton_gemv import gemv, gemv_silu
from probe_common import graph_us


def main():
    torch.manual_seed(0)
    dev, L, H, inter = "cuda", 32, 4096, 14336
    gu_w = [torch.randn(2 * inter, H, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    down_w = [torch.randn(H, inter, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(L)]
    norm_w = torch.ones(H, dtype=torch.bfloat16, device=dev)
    x = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    res = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    want = triton_fused.silu_and_mul(F.linear(x, gu_w[0]))
    got = gemv_silu(x, gu_w[0], pdl=True)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    print(torch.cuda.get_device_name(), "max |gemv_silu - cuBLAS + silu|", (got - want).abs().max().item(), flush=True)

    def chain(fused: bool, with_down: bool = True):
        def fn():
            for i in range(L):
                normed, _ = triton_fused.rms_norm(x, norm_w, 1e-5, res, pdl=True)
                act = gemv_silu(normed, gu_w[i], pdl=True) if fused else \
                    triton_fused.silu_and_mul(F.linear(normed, gu_w[i]), pdl=True)
                if with_down:
                    gemv(act, down_w[i], pdl=True)
        return fn

    for rep in range(3):
        for fused in (False, True):
            name = "gemv_silu" if fused else "cuBLAS + silu"
            print(f"rep {rep} {name:14s}: norm+gate_up+silu+down {graph_us(chain(fused), L):7.2f} us/layer; "
                  f"without down {graph_us(chain(fused, False), L):7.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
