#!/usr/bin/env bash
# One device call (repo root there, .whl carried): the server at rate inf (1,000 x 256 in / 128 out, 8 client
# processes, 2 front ends, async scheduling) with bench serving's client on aiohttp and on httpx alternating, the
# offline peer in the first and last runs; then one run of a copy patched with engine_timeline.patch and its
# summary (timeline_summary.py). Logs as $OUT/serving_round.tgz.
set -uo pipefail
source bench/device/on_device.sh
[ -d /tmp/site/aiohttp ] || wheels
nvidia-smi --query-gpu=name --format=csv,noheader
back=$OUT out=/tmp/serving_round here=$PWD
mkdir -p $out
SECONDS=0
serve() {  # TREE NAME ARGS...
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=$tree:/tmp/site python3 -u bench/serving.py --request-rates inf --num-prompts 1000 \
    --client-processes 8 --api-server-count 2 --async-scheduling --output-dir $out --name $name "$@") 2>&1 \
    | grep -v "^Triton compiled" > $out/$name.log
  echo "== $name (${SECONDS}s)"; grep -h "output tok/s\|^peer\|busy\|    inf" $out/$name.log
}
serve $here aiohttp_1
serve $here httpx_1 --no-offline --http-client httpx
serve $here aiohttp_2 --no-offline
serve $here httpx_2 --no-offline --http-client httpx
serve $here aiohttp_3
mkdir -p /tmp/traced && cp -r nanovllm bench pyproject.toml docs /tmp/traced/
(cd /tmp/traced && patch -p1 -s < docs/results/thirtyeighth/engine_timeline.patch) && rm -f /tmp/timeline_*
serve /tmp/traced traced --no-offline
python3 docs/results/thirtyeighth/timeline_summary.py $out/traced.json /tmp | tee $out/traced_summary.log
cp /tmp/timeline_*.txt $out/ 2>/dev/null
(cd $out && tar czf "$back/serving_round.tgz" .)
echo "all done at ${SECONDS}s"
