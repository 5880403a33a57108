"""A burst of requests written at once to a running `nanovllm serve`: how soon the first ones get their tokens.

At rate inf every request arrives in the same instant, and the front end decides how soon the engine sees the
first of them: through a thread-pool round trip per request, the first of 500 reached the engine only after the
event loop had taken in a few hundred (docs/BENCHMARKS.md). The client here costs almost nothing: N connections
opened before the clock starts, each request's bytes written in one loop, raw SSE lines read. Per burst it prints
the time of the first token (TTFT) at min / p10 / p50 / p90 / max against the peer: the same server's TTFT for one
request alone, measured just before.

    nanovllm serve MODEL --max-pending-requests 4096 ... &
    python3 bench/burst.py --url http://127.0.0.1:8000 --requests 500 --bursts 3 [--prompt-len 256]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import time
from urllib.parse import urlparse


def request_bytes(host: str, model: str, prompt: list[int], max_tokens: int) -> bytes:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def first_token_times(host: str, port: int, bodies: list[bytes]) -> list[float]:
    """Seconds from writing every body (one connection each) to each response's first SSE data line."""
    connections = [await asyncio.open_connection(host, port) for _ in bodies]
    start = time.perf_counter()
    for (_, writer), body in zip(connections, bodies):
        writer.write(body)

    async def first_token(reader: asyncio.StreamReader) -> float:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the server answered {status!r}: start it with --max-pending-requests >= the burst")
        await reader.readuntil(b"data: ")
        return time.perf_counter() - start

    try:
        return list(await asyncio.gather(*(first_token(reader) for reader, _ in connections)))
    finally:
        for _, writer in connections:
            writer.close()


def served_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def quantiles(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    picks = [ordered[round(q * (len(ordered) - 1))] for q in (0, 0.1, 0.5, 0.9, 1)]
    return " / ".join(f"{1e3 * s:.0f}" for s in picks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="a running nanovllm serve, e.g. http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=500, help="requests per burst (default: 500)")
    ap.add_argument("--bursts", type=int, default=3, help="bursts, one after the other (default: 3)")
    ap.add_argument("--prompt-len", type=int, default=256, help="random token ids per prompt (default: 256)")
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens per request (default: 2)")
    ap.add_argument("--vocab-size", type=int, default=2048, help="prompt ids are drawn below this (default: 2048)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * args.requests + 64)), hard))
    parsed = urlparse(args.url)
    host, port, model = parsed.hostname, parsed.port or 80, served_model(args.url)
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    bodies = [request_bytes(host, model, prompt, args.max_tokens) for prompt in prompts]
    print(f"{args.requests} requests of {args.prompt_len} token ids x {args.max_tokens} tokens per burst; "
          f"TTFT ms min / p10 / p50 / p90 / max")
    for burst in range(args.bursts):
        alone = min(asyncio.run(first_token_times(host, port, bodies[:1]))[0] for _ in range(3))
        times = asyncio.run(first_token_times(host, port, bodies))
        print(f"burst {burst + 1}: {quantiles(times)}; one request alone {1e3 * alone:.0f} ms "
              f"(burst p10 = {sorted(times)[round(0.1 * (len(times) - 1))] / alone:.1f}x alone)", flush=True)


if __name__ == "__main__":
    main()
