#!/usr/bin/env bash
# One device call: the granule-sums kernel's column block and warps (sums_tune.py), then the CUDA tests of the
# engine process, decode graphs, async scheduling, graph copies and dependent launches. Logs as $OUT/check.tgz.
set -uo pipefail
source bench/device/on_device.sh
out=/tmp/check_round back=$OUT
mkdir -p $out
bundle() { (cd $out && tar czf "$back/check.tgz" .); }
timeout 90 python3 -u docs/results/fortieth/sums_tune.py 2>&1 | grep -v "^Triton compiled" | tee $out/sums_tune.log
bundle
timeout 270 python3 -m pytest -q -m cuda tests/test_engine_process.py tests/test_decode_graphs.py \
  tests/test_async_scheduling.py tests/test_graph_copies.py tests/test_dependent_launch.py 2>&1 | tail -8 \
  | tee $out/tests.log
bundle
