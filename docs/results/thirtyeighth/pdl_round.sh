#!/usr/bin/env bash
# One device call (repo root there, .whl carried): the throughput workload with dependent launches on and off
# alternating twice, the dependent-launch CUDA tests, batch-1 / batch-32 decode on and off; logs as $OUT/pdl_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/annotated_types ] || wheels
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
back=$OUT out=/tmp/pdl_round
mkdir -p $out
export OUT=$out
SECONDS=0
bash bench/device/speed_round.sh pdl_throughput
echo "throughput pairs done at ${SECONDS}s"
python3 -m pytest -q -x -m cuda tests/test_dependent_launch.py tests/test_gemv.py tests/test_fused_ops.py 2>&1 \
  | tail -3 | tee "$out/tests_pdl.log"
for name in pdl plain; do
  flag=--dependent-launch; [ $name = plain ] && flag=--no-dependent-launch
  (cd bench && OUT=$out/latency_$name python3 -u latency.py --skip-hf --prefill-contexts 8192 --async-scheduling \
    $flag) 2>&1 | grep -v "^Triton compiled" | tee "$out/latency_$name.log"
done
echo "all done at ${SECONDS}s"
grep -h "of the floor\|ms/token" $out/*.log
(cd $out && tar czf "$back/pdl_round.tgz" .)
