"""Load generator run as its own process by test_serving_load.py.

    python tests/load_client.py URL PROMPTS_JSON --requests 100 --disconnect-fraction 0.2 --max-tokens 16

Fires every request at once as a streaming completion; a random subset hangs up after a few chunks.
Prints one JSON list: per request its prompt index, whether it hung up, status, text and finish reason.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random

import httpx


async def one(client: httpx.AsyncClient, index: int, prompt: str, max_tokens: int, hang_up_after: int | None) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    result = {"index": index, "aborted": hang_up_after is not None, "status": None, "text": "", "finish_reason": None,
              "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result["status"] = response.status_code
        chunks = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                result["text"] += choice["text"]
                result["finish_reason"] = choice["finish_reason"]
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    break  # leaving the block closes the connection mid-stream
    return result


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="server base URL")
    ap.add_argument("prompts", help="JSON list of prompts; request i uses prompt i mod len")
    ap.add_argument("--requests", type=int, default=100, help="concurrent streaming requests")
    ap.add_argument("--disconnect-fraction", type=float, default=0.2, help="share of requests that hang up early")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    ap.add_argument("--seed", type=int, default=0, help="seed of who hangs up and when")
    args = ap.parse_args()
    prompts = json.loads(args.prompts)
    rng = random.Random(args.seed)
    plan = [rng.randint(1, 3) if rng.random() < args.disconnect_fraction else None for _ in range(args.requests)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(300), limits=limits) as client:
        results = await asyncio.gather(*(one(client, i, prompts[i % len(prompts)], args.max_tokens, plan[i])
                                         for i in range(args.requests)))
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main())
