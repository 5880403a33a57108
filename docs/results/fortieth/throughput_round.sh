#!/usr/bin/env bash
# One device call: the throughput workload (async) against its HBM floor, then where its run's time goes
# (bench/profile_run.py: steps by batch, three profiled windows, the tail included). Logs as $OUT/throughput.tgz.
set -uo pipefail
source bench/device/on_device.sh
out=/tmp/throughput_round back=$OUT
mkdir -p $out
bundle() { (cd $out && tar czf "$back/throughput.tgz" .); }
(cd bench && OUT=$out timeout 200 python3 -u throughput.py --async-scheduling --hf-seqs 0) 2>&1 \
  | grep -v "^Triton compiled\|it/s" | tee $out/throughput.log | tail -3
bundle
(cd bench && OUT=$out timeout 240 python3 -u profile_run.py --async-scheduling --windows 50 600 900) 2>&1 \
  | grep -v "^Triton compiled\|it/s" | tee $out/profile_run.log | tail -25
bundle
