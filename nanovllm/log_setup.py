"""Where nanovllm's own log lines go when run from the command line (and in the server's engine process)."""
from __future__ import annotations

import logging


def configure_logging() -> None:
    """nanovllm's INFO lines (the KV pool at start, requests with --enable-log-requests) on stderr."""
    log = logging.getLogger("nanovllm")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
