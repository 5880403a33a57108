#!/usr/bin/env bash
# The next device call (carry .whl and .models/old39, the tree at c01e16a): bench serving at rate inf with this
# tree and the session's start alternating; each run prints the forward's host time per step kind for the server
# and the offline peer (new here: EngineStats.forward_seconds), the server's engine process now on one torch thread,
# the eager steps' lists through numpy and the wrappers' sizes in plain Python. Logs as $OUT/next_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
here=$PWD back=$OUT out=/tmp/next_round
mkdir -p $out
for tree in new old new old; do
  root=$here; [ $tree = old ] && root=$here/.models/old39
  (cd $root && PYTHONPATH=$root:/tmp/site timeout 140 python3 -u $here/bench/serving.py --request-rates inf \
    --num-prompts 1000 --client-processes 8 --api-server-count 2 --async-scheduling --output-dir $out \
    --name ${tree}_$RANDOM) 2>&1 | grep "output tok/s\|^peer\|engine steps" | sed "s/^/$tree: /" | tee -a $out/ab.log
  (cd $out && tar czf "$back/next_round.tgz" .)
done
