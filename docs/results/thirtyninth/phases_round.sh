#!/usr/bin/env bash
# One device call: (1) bench serving at rate inf (as serving_round.sh) with the engine's host time per step phase
# recorded in every process (phases/sitecustomize.py): the server's engine process against the offline peer of the
# same bench process (phases_summary.py); (2) the XAttention 128K prefill's kernels by op and shape (e2e_probe.py).
# Logs as $OUT/phases_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/phases_round
mkdir -p $out && rm -f /tmp/phases_*
NANOVLLM_PHASES=1 PYTHONPATH=$here/docs/results/thirtyninth/phases:$PYTHONPATH python3 -u bench/serving.py \
  --request-rates inf --num-prompts 1000 --client-processes 8 --api-server-count 2 --async-scheduling \
  --output-dir $out --name phases 2>&1 | grep -v "^Triton compiled" > $out/phases.log
grep -h "output tok/s\|^peer\|busy" $out/phases.log
cp /tmp/phases_*.txt $out/
python3 docs/results/thirtyninth/phases_summary.py /tmp | tee $out/phases_summary.log
(cd $out && tar czf "$back/phases_round.tgz" .)
(cd bench && PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 -u $here/docs/results/thirtyninth/e2e_probe.py \
  --policies xattention) 2>&1 | grep -v "^Triton compiled" > $out/e2e_shapes.log
grep -v "^  shape\|^  kernel" $out/e2e_shapes.log | tail -5
(cd $out && tar czf "$back/phases_round.tgz" .)
