# Usage: python probe_aiohttp.py URL N TOKENS (a server of the tiny config, as http_client_ab.sh builds, at URL)
# Probe: as client_probe.py, with aiohttp (vLLM's benchmark client); full streams read, CPU seconds printed.
import asyncio, json, sys, time
import aiohttp
url, n, ntok = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
async def main():
    resp, first = [], []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
        async def one(i):
            body = {"model": "tiny", "prompt": [5 + i % 100] * 64, "max_tokens": ntok, "temperature": 0, "ignore_eos": True, "stream": True}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                resp.append(time.time()); f = True; toks = 0
                async for line in r.content:
                    line = line.strip()
                    if line.startswith(b"data: {"):
                        json.loads(line[6:]); toks += 1
                        if f: first.append(time.time()); f = False
                return toks
        t0, c0 = time.time(), time.process_time()
        toks = await asyncio.gather(*[one(i) for i in range(n)])
        t1 = time.time()
    for k, v in (("resp", resp), ("first", first)):
        v.sort(); print(f"{k:6s} first {1e3*(v[0]-t0):7.1f} ms, 10% {1e3*(v[len(v)//10]-t0):7.1f}, 50% {1e3*(v[len(v)//2]-t0):7.1f}, last {1e3*(v[-1]-t0):7.1f}")
    print(f"done {1e3*(t1-t0):.0f} ms, {sum(toks)} tokens, client CPU {time.process_time()-c0:.2f} s = {1e6*(time.process_time()-c0)/sum(toks):.1f} us/token")
asyncio.run(main())
