# Experiment: the key copy's page scores with the copy laid out head-major (scales, or codes and scales) against
# the engine's token-major layout, same values, GPU time from graph replays.
import sys
sys.path.insert(0, "bench")
import torch
from common import graph_ms, measure_hbm_bandwidth
from tune_quest import key_copy_inputs
from nanovllm.kernels import triton_quest

def head_major(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1)

bw = measure_hbm_bandwidth()
for bits in (8, 4):
    for batch, context in [(1, 131072), (4, 131072), (16, 32768)]:
        call, nbytes = key_copy_inputs(batch, context, bits)
        q, codes, scales, hc, hs, *rest = call
        variants = {"token-major": call,
                    "scales head-major": (q, codes, head_major(scales), hc, hs, *rest),
                    "codes and scales head-major": (q, head_major(codes), head_major(scales), hc, hs, *rest)}
        want = triton_quest.key_copy_scores(*call, pages=True, bits=bits)
        line = []
        base = None
        for name, c in variants.items():
            got = triton_quest.key_copy_scores(*c, pages=True, bits=bits)
            assert torch.equal(got, want), name
            t = graph_ms(lambda: triton_quest.key_copy_scores(*c, pages=True, bits=bits))
            base = base or t
            line.append(f"{name} {t * 1e3:.1f} us ({nbytes / t / 1e-3 / bw:.2f} HBM, {base / t:.2f}x)")
        print(f"int{bits} {batch}x{context}: " + "; ".join(line), flush=True)
