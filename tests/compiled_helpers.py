"""Run a snippet in a fresh interpreter with Triton's compiler, not its CPU interpreter: the interpreter accepts
code the compiler rejects, and the tests that set TRITON_INTERPRET=1 have already imported Triton."""
from __future__ import annotations

import os
import subprocess
import sys


def assert_runs_compiled(code: str, timeout: int) -> None:
    """Run code (which prints "ok" last) without TRITON_INTERPRET; fail with its stderr's tail otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
