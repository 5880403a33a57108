"""One log line per request (`nanovllm serve --enable-log-requests`, as vLLM's), off unless enabled.

`LLMEngine.add_request` calls `log_request` for every request it queues, so the server needs no code of
its own; any other caller (the server's own request path, say) may call it the same way.
"""
from __future__ import annotations

import logging

from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm.requests")
_enabled = False


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def log_request(request_id: str, prompt_len: int, params: SamplingParams) -> None:
    if _enabled:
        logger.info("Received request %s: prompt tokens: %d, params: %s", request_id, prompt_len, params)
