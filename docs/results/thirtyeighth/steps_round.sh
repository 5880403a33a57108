#!/usr/bin/env bash
# One device call: (1) the serving workload offline, profiled (bench/profile_run.py --workload serving): the first
# wave's mixed steps, decode steps, the second wave's mixed steps, each window's wall against GPU busy time;
# (2) bench serving (rate inf, as serving_round.sh, aiohttp client) on a copy patched with engine_steps.patch, the
# offline peer in the same bench process: the steps' times by kind on both sides (steps_compare.py); (3) the CUDA
# tests of the kernels and graphs with dependent launches on by default. Logs as $OUT/steps_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
back=$OUT out=/tmp/steps_round
mkdir -p $out
(cd bench && OUT=$out python3 -u profile_run.py --async-scheduling --workload serving --windows 1 60 137 \
  --window-steps 8) 2>&1 | grep -v "^Triton compiled" > $out/profile_serving.log
grep "ms/step wall\|whole run" $out/profile_serving.log
(cd $out && tar czf "$back/steps_round.tgz" .)
mkdir -p /tmp/stepped && cp -r nanovllm bench pyproject.toml docs /tmp/stepped/
(cd /tmp/stepped && patch -p1 -s < docs/results/thirtyeighth/engine_steps.patch) && rm -f /tmp/timeline_*
(cd /tmp/stepped && PYTHONPATH=/tmp/stepped:/tmp/site python3 -u bench/serving.py --request-rates inf \
  --num-prompts 1000 --client-processes 8 --api-server-count 2 --async-scheduling --output-dir $out \
  --name stepped) 2>&1 | grep -v "^Triton compiled" > $out/stepped.log
grep -h "output tok/s\|^peer\|busy" $out/stepped.log
python3 docs/results/thirtyeighth/steps_compare.py /tmp | tee $out/steps_compare.log
python3 docs/results/thirtyeighth/timeline_summary.py $out/stepped.json /tmp > $out/stepped_summary.log
cp /tmp/timeline_*.txt $out/
(cd $out && tar czf "$back/steps_round.tgz" .)
timeout 100 python3 -m pytest -q -m cuda tests/test_dependent_launch.py tests/test_kernels.py tests/test_fused_ops.py \
  tests/test_gemv.py tests/test_graph_copies.py tests/test_async_scheduling.py 2>&1 | tail -4 | tee $out/tests_cuda.log
(cd $out && tar czf "$back/steps_round.tgz" .)
