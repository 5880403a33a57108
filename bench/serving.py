"""Online serving: Poisson arrivals at several request rates against `nanovllm serve`, in one run.

Starts `nanovllm serve` on the model (a subprocess on a free port), sends N streaming completions per rate
(random-token prompts, ignore_eos, exact output lengths), reports TTFT, TPOT and E2E at p50/p90/p99 and
output throughput per rate, then runs the same prompts offline through LLM.generate as the peer: the
throughput no arrival rate can exceed. JSON and a PNG chart go to $OUT (or bench/results).

    PYTHONPATH=$PWD python3 bench/serving.py [--model bench/configs/qwen3-0.6b --load-format dummy]
        [--request-rates 8,32,128,inf --num-prompts 300 --input-len 256 --output-len 128]

The server needs the `serve` extra (starlette, uvicorn, httpx, pydantic, prometheus_client; all pure Python
but pydantic_core; uvloop and httptools where installed, else asyncio and h11). Without network access, carry the wheels in .whl/ (`pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl ...`, the target
machine's Python for pydantic_core) and this script installs them with `pip install --no-index
--find-links .whl --target .whl/site` before it starts.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = WHEELS / "site"
NEEDED = {"starlette": "starlette==0.52.1", "uvicorn": "uvicorn==0.40.0", "httpx": "httpx==0.28.1",
          "httpcore": "httpcore==1.0.9", "h11": "h11==0.16.0", "anyio": "anyio", "click": "click", "idna": "idna",
          "certifi": "certifi", "typing_extensions": "typing_extensions", "pydantic": "pydantic==2.14.4",
          "pydantic_core": "pydantic_core==2.50.5", "annotated_types": "annotated_types",
          "typing_inspection": "typing_inspection", "prometheus_client": "prometheus_client==0.26.0",
          **({"exceptiongroup": "exceptiongroup"} if sys.version_info < (3, 11) else {})}


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def ensure_server_packages() -> None:
    """Make starlette/uvicorn/httpx importable here and in the server subprocess, from .whl/ if need be."""
    if SITE.is_dir():
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    missing = missing_modules()
    if not missing:
        return
    if not any(WHEELS.glob("*.whl")):
        sys.exit(f"missing Python packages: {', '.join(missing)}. Install them with\n"
                 f"    pip install {' '.join(NEEDED[m] for m in missing)}\n"
                 f"or, offline, carry wheels made elsewhere with\n"
                 f"    pip download --no-deps --only-binary=:all: --python-version X.Y --platform manylinux2014_x86_64 "
                 f"-d .whl {' '.join(NEEDED.values())}")
    # all of NEEDED, not only the missing ones, so that versions match (anyio needs a recent typing_extensions)
    print(f"missing {', '.join(missing)}: installing {', '.join(NEEDED)} from {WHEELS} into {SITE}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                    str(WHEELS), "--target", str(SITE), *NEEDED.values()], check=True)
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    if missing_modules():
        sys.exit(f"still missing after installing from {WHEELS}: {', '.join(missing_modules())}")


def main() -> None:
    ensure_server_packages()
    from nanovllm.engine_args import add_engine_options, engine_options
    from nanovllm.serving_bench import add_bench_arguments, engine_args_from, run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(ap)
    add_engine_options(ap)
    ap.set_defaults(model=str(ROOT / "bench" / "configs" / "qwen3-0.6b"), request_rates="8,32,128,inf",
                    num_prompts=300, load_format="dummy", max_model_len=2048)
    args = ap.parse_args()
    options = engine_options(args)
    run(args, options, engine_args_from(options))


if __name__ == "__main__":
    main()
