"""Summary of a traced server run (engine_timeline.patch applied): where, against the client's run, the engine got
its requests, stepped and idled, and when the front ends had the last outputs.
Usage: python timeline_summary.py RESULT.json TIMELINE_DIR"""
import glob
import json
import sys

run = json.load(open(sys.argv[1]))["rates"][0]
t0, t1 = run["started_at"], run["ended_at"]
ms = lambda t: f"{1e3 * (t - t0):7.1f}"  # noqa: E731
print(f"run {t1 - t0:.3f} s ({run.get('http_client', '?')} client, {run['output_throughput_tok_s']:.0f} tok/s)")
for path in sorted(glob.glob(sys.argv[2] + "/timeline_*.txt")):
    marks: dict[str, list[tuple[float, int]]] = {}
    for line in open(path):
        kind, t, n = line.split()
        t = float(t)
        if t0 - 1 < t < t1 + 1:
            marks.setdefault(kind, []).append((t, int(n)))
    if "step" in marks:  # the engine process
        adds = [t for t, n in marks.get("recv", []) if n]
        print(f"engine: requests in at ms {ms(adds[0])} (first) {ms(adds[len(adds) // 2])} (half) "
              f"{ms(adds[-1])} (last), {len(adds)} in all")
        steps = [(a, b, n) for (a, n), (b, _) in zip(marks["step"], marks["stepped"])]
        busy = sum(b - a for a, b, _ in steps)
        print(f"  {len(steps)} steps, {busy:.3f} s in steps; first at ms {ms(steps[0][0])}, last ends {ms(steps[-1][1])}; "
              f"the run's end {ms(t1)}")
        for k in range(10):
            a, b = t0 + (t1 - t0) * k / 10, t0 + (t1 - t0) * (k + 1) / 10
            inside = sum(max(0.0, min(e, b) - max(s, a)) for s, e, _ in steps)
            between = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1) if a <= steps[i][1] < b]
            print(f"  tenth {k}: busy {inside / (b - a):.2f}, {len(between)} gaps, largest "
                  f"{1e3 * max(between, default=0):.1f} ms, sum {1e3 * sum(between):.1f} ms")
        applied = marks.get("applied", [])
        print(f"  commands applied in {len(applied)} batches: " +
              ", ".join(f"{n} at {ms(t).strip()}" for t, n in applied[:12]))
    else:  # a front end
        posts = [t for t, n in marks.get("fe_post", []) if n]
        got = marks.get("fe_stepped", [])
        done = [t for t, n in got if n]
        print(f"front end {path}: {len(posts)} requests posted, ms {ms(posts[0])} .. {ms(posts[-1])}; "
              f"last output in at ms {ms(got[-1][0]) if got else '-'}, last finished at {ms(done[-1]) if done else '-'}")
