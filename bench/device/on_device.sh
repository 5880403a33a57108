# Helpers for a GPU block's calls on the device machine: `source bench/device/on_device.sh` at the start of
# each call's command (repo root there). State between calls of one lease lives in /tmp (the machine is bare
# after it goes back).
#   wheels                       install the carried .whl/ into /tmp/site (once per machine)
#   keep PATH...                 copy carried pieces/samples to /tmp/m (every call that carries some)
#   assemble smol|qwen           cat the pieces in /tmp/m, check the sha256, convert to /tmp/smol or /tmp/qwen
#   ruler_bg NAME DIR ARGS...    python -m nanovllm.eval.ruler.sparse ARGS --output DIR/NAME, in the background
#                                (survives the call), log DIR/NAME.log
#   wait_runs SECONDS            wait until no background RULER run is left, at most SECONDS
#   tables DIR                   each run's table, each model's runs as one table (ruler.sparse --combine),
#                                failures, and DIR's tables and logs as $OUT/tables_<dir>.tgz
#                                (at most 8 files come back from $OUT: bundle, do not copy logs one by one)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site

wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}

keep() { mkdir -p /tmp/m && cp "$@" /tmp/m/; }

assemble() {
  local name=$1 sha dtype pieces
  case $name in
    smol) pieces="/tmp/m/s.part*"; dtype=float32; sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ;;
    qwen) pieces="/tmp/m/q.part*"; dtype=bfloat16; sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
    *) echo "assemble smol|qwen" >&2; return 1 ;;
  esac
  cat $pieces > /tmp/m/$name.gguf
  echo "$sha  /tmp/m/$name.gguf" | sha256sum -c - || return 1
  mkdir -p /tmp/$name && python3 -c "from pathlib import Path; from nanovllm.models.fetch import convert_gguf
convert_gguf(Path('/tmp/m/$name.gguf'), Path('/tmp/$name'), '$dtype', progress=False)"
}

ruler_bg() {
  local name=$1 dir=$2; shift 2
  mkdir -p "$dir"
  setsid nohup python3 -m nanovllm.eval.ruler.sparse --no-progress --output "$dir/$name" "$@" > "$dir/$name.log" 2>&1 &
}

wait_runs() {
  local end=$((SECONDS + $1))
  while pgrep -f "eval.ruler.sparse" > /dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
  pgrep -af "eval.ruler.sparse" | grep -o -- "--output [^ ]*" || true
}

tables() {
  local dir=$1 model
  for f in "$dir"/*/sparse.md; do echo "== $f"; sed -n 3,6p "$f"; done
  for model in smol qwen; do  # sparse_table.sh's runs of one model as one table
    local runs=$(ls "$dir"/${model}_*/sparse.json 2>/dev/null | grep -v "_combined/")
    [ -n "$runs" ] || continue
    echo "== $model, combined"
    python3 -m nanovllm.eval.ruler.sparse --combine $runs --output "$dir/${model}_combined"
  done
  grep -l "Traceback" "$dir"/*.log 2>/dev/null | while read -r f; do echo "== FAILED $f"; tail -5 "$f"; done
  (cd "$dir" && tar czf "$OUT/tables_$(basename "$dir").tgz" */sparse.md */sparse.json ./*.log 2>/dev/null) || true
}
