"""The one-pass Triton sampler (kernels/triton_sampler.py) per decode batch: its default launch (the vocabulary of a
row split over several programs) against one program per row (the launch before 2026-12-05) in the same process,
and both against the floor of reading the logits once at the measured HBM copy rate. Temperature 0.6 on every
row, as the throughput workload samples. --dtype bfloat16 (the model's logits as the engine now passes them) also
times casting them to float32 first (what a decode graph did before 2026-12-05).

    PYTHONPATH=. python3 bench/sampler.py [--batches 1 16 30 64 128 256] [--vocab 151936] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

import torch

from common import cuda_ms, log, measure_hbm_bandwidth, require_cuda, save_results
from nanovllm.kernels import triton_sampler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 30, 64, 128, 256])
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary by default")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    require_cuda()
    bandwidth = measure_hbm_bandwidth()
    log(f"HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device="cuda").to(dtype)
        temps = torch.full((batch,), 0.6, device="cuda")
        seeds = torch.arange(batch, device="cuda")
        split = triton_sampler.vocab_splits(batch, args.vocab, triton_sampler.CHUNK,
                                            torch.cuda.get_device_properties(0).multi_processor_count)[0]
        new = triton_sampler.sample_tokens(logits, temps, seeds)
        old = triton_sampler.sample_tokens(logits, temps, seeds, splits=1)
        if not torch.equal(new, old):
            raise SystemExit(f"batch {batch}: the split launch sampled other tokens than one program per row")
        new_ms = cuda_ms(lambda: triton_sampler.sample_tokens(logits, temps, seeds))
        old_ms = cuda_ms(lambda: triton_sampler.sample_tokens(logits, temps, seeds, splits=1))
        floor_ms = logits.nbytes / bandwidth * 1e3  # the copy rate counts every byte read or written
        row = dict(batch=batch, splits=split, ms=new_ms, one_program_per_row_ms=old_ms, floor_ms=floor_ms)
        line = (f"batch {batch:4d}: {split:3d} splits {new_ms * 1e3:7.1f} us, one program per row {old_ms * 1e3:7.1f} "
                f"us ({old_ms / new_ms:.2f}x); read floor {floor_ms * 1e3:6.1f} us ({new_ms / floor_ms:.1f}x / "
                f"{old_ms / floor_ms:.1f}x the floor)")
        if dtype != torch.float32:
            cast_ms = row["cast_first_ms"] = cuda_ms(lambda: triton_sampler.sample_tokens(logits.float(), temps, seeds))
            line += f"; cast to float32 first {cast_ms * 1e3:7.1f} us ({cast_ms / new_ms:.2f}x)"
        rows.append(row)
        log(line)
    save_results(f"sampler_{args.dtype}", {"vocab": args.vocab, "dtype": args.dtype, "hbm_copy_bytes_per_s": bandwidth,
                                           "rows": rows})


if __name__ == "__main__":
    main()
