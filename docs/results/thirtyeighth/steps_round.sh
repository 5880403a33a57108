#!/usr/bin/env bash
# One device call: bench serving (rate inf, as serving_round.sh, aiohttp client) on a copy patched with
# engine_steps.patch (and the offline peer in the same bench process), the steps' times by kind on both sides.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
back=$OUT out=/tmp/steps_round
mkdir -p $out /tmp/stepped && cp -r nanovllm bench pyproject.toml docs /tmp/stepped/
(cd /tmp/stepped && patch -p1 -s < docs/results/thirtyeighth/engine_steps.patch) && rm -f /tmp/timeline_*
(cd /tmp/stepped && PYTHONPATH=/tmp/stepped:/tmp/site python3 -u bench/serving.py --request-rates inf \
  --num-prompts 1000 --client-processes 8 --api-server-count 2 --async-scheduling --output-dir $out \
  --name stepped "$@") 2>&1 | grep -v "^Triton compiled" > $out/stepped.log
grep -h "output tok/s\|^peer\|busy" $out/stepped.log
python3 docs/results/thirtyeighth/steps_compare.py /tmp | tee $out/steps_compare.log
python3 docs/results/thirtyeighth/timeline_summary.py $out/stepped.json /tmp > $out/stepped_summary.log
cp /tmp/timeline_*.txt $out/
(cd $out && tar czf "$back/steps_round.tgz" .)
