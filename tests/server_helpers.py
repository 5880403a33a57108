"""Start `nanovllm serve` as a subprocess on a free port and wait for /health (shared by the server tests)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

from nanovllm.server.metrics import parse_metrics
from nanovllm.serving_bench import free_port, wait_healthy

# Small enough for a 2-core CPU: fp32, 16-token blocks, a bounded KV pool and context.
SMALL_ENGINE = ["--dtype", "float32", "--kvcache-block-size", "16", "--max-model-len", "256",
                "--max-num-batched-tokens", "512"]


class ServerProcess:
    def __init__(self, model: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 model_option: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "nanovllm.cli", "serve", *(["--model"] if model_option else []), str(model),
               "--port", str(self.port),
               "--served-model-name", "smollm2", "--log-level", "warning", *SMALL_ENGINE, *args]
        inherited = {k: v for k, v in os.environ.items() if k != "NANOVLLM_API_KEY"}  # no key unless asked for
        env = {**inherited, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}; server log:\n{self.log_path.read_text()[-3000:]}") from e

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 30.0, until: Callable[[dict[str, float]], bool] | None = None
                  ) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds KV blocks and `until` holds. Aborts reach the engine
        asynchronously, and a request's end is counted by the output thread after the engine let it go."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["nanovllm:num_requests_running"] == m["nanovllm:num_requests_waiting"] == 0 \
                and m['nanovllm:kv_blocks_used{pool="gpu"}'] == 0 and m["nanovllm:num_requests_pending"] == 0
            if (idle and (until is None or until(m))) or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def rss_mib(self) -> float:
        """The server process's resident memory."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
