# The engine's arrival times for a burst (thirty-seventh session): apply engine_arrival_trace.patch, then
# bash arrival_trace.sh [ENV=VALUE...] (a server of the tiny config at /tmp/fes/tiny on port 8199; burst_client.py)
cd /work/main && source .venv/bin/activate
pkill -f "serve /tmp/fes/tiny"; sleep 2; rm -f /tmp/trace_*
(env "$@" nanovllm serve /tmp/fes/tiny --load-format dummy --device cpu --dtype float32 --max-model-len 512 --num-gpu-blocks 8192 --kvcache-block-size 16 --max-num-seqs 256 --port 8199 --served-model-name tiny --max-pending-requests 4096 > /tmp/srv.log 2>&1 &)
for i in $(seq 60); do curl -s localhost:8199/health >/dev/null && break; sleep 1; done; ulimit -n 4096
for k in 1 2 3; do
python docs/results/thirtyseventh/burst_client.py 8199 ${N:-500} > /tmp/burst_out.txt
python3 - <<'PY'
import glob
t0=float(open('/tmp/burst_out.txt').readline().split()[1])
for f in glob.glob('/tmp/trace_*.txt'):
    lines=[l.split() for l in open(f)]
    lines=[l for l in lines if float(l[1])>t0-0.01]
    adds=[ (float(l[1])-t0)*1e3 for l in lines if l[0]=='add']
    if not adds: continue
    out=[];cnt=0
    for l in lines:
        if l[0]=='add': cnt+=1
        else: out.append(cnt); cnt=0
    print("engine got requests at ms: first %.0f, 10%% %.0f, 50%% %.0f, last %.0f; adds per step %s" % (adds[0], adds[len(adds)//10], adds[len(adds)//2], adds[-1], [o for o in out if o][:12]))
PY
sleep 1; done
