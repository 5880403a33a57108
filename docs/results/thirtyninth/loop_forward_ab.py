"""Is the same forward pass slower on the host in the server's engine loop than offline? (CPU, no device.)

A 28-layer config of the Qwen3 shape at width 128 on the Triton backend with every kernel launch and GEMM stubbed
out (TRITON_INTERPRET=1): a forward pass costs the host what our own Python costs. The serving workload's requests
(256 in / 16 out, 32 prompts a step beside decode rows) run offline (`LLMEngine.step_states`) and through the engine
process's loop body (`EngineLoop` over `_FrontEnds`, its events written by their writer thread to a pipe that another
process reads), alternating; the engine's forward_seconds per step kind tell the host's time in forward passes.

    python docs/results/thirtyninth/loop_forward_ab.py [--rounds 3] [--requests 512] [--threads 1] [--offline-only]
    NANOVLLM_TREE=OTHER_TREE python docs/results/thirtyninth/loop_forward_ab.py ...   (another tree's package)
"""
import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

InterpretedFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)  # launches cost nothing
F.linear = lambda x, w, b=None: x.new_empty(*x.shape[:-1], w.shape[0])  # nor do the GEMMs: their dispatch only

sys.path.insert(0, os.environ.get("NANOVLLM_TREE", str(Path(__file__).resolve().parents[3])))  # a tree to time
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.step_plan import STEP_KINDS  # noqa: E402
from nanovllm.server.engine_core import _FrontEnds  # noqa: E402
from nanovllm.server.engine_loop import EngineLoop  # noqa: E402

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32, "hidden_act": "silu",
          "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 4096, "num_attention_heads": 4,
          "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
          "tie_word_embeddings": True, "torch_dtype": "float32", "vocab_size": 2048}


def requests(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(256)] for _ in range(n)]


def drain(connection) -> None:
    while True:
        if RAW_READER:  # the bytes only: no unpickling beside the engine
            try:
                connection.recv_bytes()
            except EOFError:
                return
        elif any(event[0] == "stopped" for event in connection.recv()):
            return


def run_offline(llm: LLM, prompts, params) -> None:
    for p in prompts:
        llm.add_request(p, params)
    while llm.has_unfinished_requests():
        llm.step_states()


class NoEvents:
    """CoreEvents that go nowhere: the loop without front ends, pipes or writer threads."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def run_loop(llm: LLM, prompts, params) -> None:
    if NO_EVENTS:
        loop = EngineLoop(llm, NoEvents(), build_outputs=False)
        for i, p in enumerate(prompts):
            loop.post(("add", f"r{i}", p, params))
        loop._next_commands()
        while llm.has_unfinished_requests():
            loop._next_commands()
            loop._step()
        return
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    reader = multiprocessing.get_context("fork").Process(target=drain, args=(receive,), daemon=True)
    reader.start()
    front_ends = _FrontEnds([send])
    loop = EngineLoop(llm, front_ends, build_outputs=False)
    for i, p in enumerate(prompts):
        loop.post(front_ends.command(front_ends.sinks[0], ("add", f"r{i}", p, params)))
    loop._next_commands()
    while llm.has_unfinished_requests():
        loop._next_commands()
        outputs = loop._step()
        front_ends.stepped(outputs, loop._first_scheduled(), 0.0, llm.stats())
        if WAIT_WRITTEN:  # the events written before the next step: nothing of theirs runs beside it
            for sink in front_ends.sinks:
                sink.flush(wait=True)
    front_ends.stopped()
    if RAW_READER:
        send.close()
    reader.join(30)


WAIT_WRITTEN = "--wait-written" in sys.argv
NO_EVENTS = "--no-events" in sys.argv
RAW_READER = "--raw-reader" in sys.argv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--wait-written", action="store_true", help="the loop waits until each step's events are written")
    ap.add_argument("--no-events", action="store_true", help="the loop's events go nowhere (no pipe, no threads)")
    ap.add_argument("--raw-reader", action="store_true", help="the reading process takes the bytes, unpickles nothing")
    ap.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    ap.add_argument("--offline-only", action="store_true")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = Path("/tmp/nanovllm_loop_forward_model")
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    llm = LLM(str(model), load_format="dummy", device="cpu", dtype="float32", attention_backend="triton",
              max_model_len=512, num_gpu_blocks=8192, kvcache_block_size=16, max_num_seqs=256,
              max_num_batched_tokens=8192, async_scheduling=True, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {"offline": [], "loop": []}
    for r in range(args.rounds):
        for mode, run in (("offline", run_offline), ("loop", run_loop))[: 1 if args.offline_only else 2]:
            before = llm.stats()
            run(llm, requests(args.requests, r), params)
            after = llm.stats()
            steps = [b - a for a, b in zip(before.steps, after.steps)]
            forward = [b - a for a, b in zip(before.forward_seconds, after.forward_seconds)]
            results[mode].append([f / n * 1e3 if n else 0.0 for f, n in zip(forward, steps)])
            print(f"round {r} {mode:7s}: steps {steps}, forward ms per step "
                  + " / ".join(f"{ms:.2f}" for ms in results[mode][-1]), flush=True)
    for mode, rows in ((m, r) for m, r in results.items() if r):
        med = [statistics.median(col) for col in zip(*rows)]
        print(f"{mode:7s} median forward ms per step " + ", ".join(f"{k} {m:.2f}" for k, m in zip(STEP_KINDS, med)))


if __name__ == "__main__":
    main()
