# Usage: python probe_raw.py PORT N (a server of the tiny config on 127.0.0.1:PORT)
# Probe: N raw HTTP/1.1 streamed requests at once over asyncio streams (no httpx), first byte times.
import asyncio, json, sys, time
host, port, n = "127.0.0.1", int(sys.argv[1]), int(sys.argv[2])
async def main():
    sent, first = [], []
    async def one(i):
        body = json.dumps({"model": "tiny", "prompt": [5 + i % 100] * 64, "max_tokens": 16, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await w.drain(); sent.append(time.time())
        await r.readuntil(b"data: {"); first.append(time.time())
        while not (await r.read(65536)).endswith(b"\r\n\r\n") and False: pass
        w.close()
    t0 = time.time()
    await asyncio.gather(*[one(i) for i in range(n)])
    for k, v in (("sent", sent), ("first", first)):
        v.sort(); print(f"{k:6s} first {1e3*(v[0]-t0):7.1f} ms, 10% {1e3*(v[len(v)//10]-t0):7.1f}, 50% {1e3*(v[len(v)//2]-t0):7.1f}, last {1e3*(v[-1]-t0):7.1f}")
asyncio.run(main())
