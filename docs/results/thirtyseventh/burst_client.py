"""N requests written at once on pre-opened connections; per request the time of its first response byte and of the
first SSE data chunk (first token)."""
import asyncio, json, random, sys, time
N = int(sys.argv[2]); port = int(sys.argv[1]); L = int(sys.argv[3]) if len(sys.argv) > 3 else 256
async def main():
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(N)]
    rng = random.Random(0)
    bodies = []
    for _ in range(N):
        body = json.dumps({"model": "tiny", "prompt": [rng.randrange(2048) for _ in range(L)], "max_tokens": 2,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        bodies.append(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
    t0 = time.perf_counter(); print('T0', time.time())
    for (r, w), b in zip(conns, bodies):
        w.write(b)
    async def read(r):
        head = await r.readuntil(b"\r\n\r\n"); t_head = time.perf_counter() - t0
        await r.readuntil(b"data: "); t_tok = time.perf_counter() - t0
        return t_head, t_tok
    times = await asyncio.gather(*(read(r) for r, _ in conns))
    for _, w in conns: w.close()
    heads = sorted(t[0] for t in times); toks = sorted(t[1] for t in times)
    q = lambda xs: " ".join(f"{xs[int(f*(len(xs)-1))]*1e3:.0f}" for f in (0, .1, .25, .5, .75, .9, 1))
    print("response headers at ms (min p10 p25 p50 p75 p90 max):", q(heads))
    print("first token at ms                                :", q(toks))
asyncio.run(main())
