# The engine's own narrowed offload step (Quest defaults, 1 x 128K, 8B shape, a 24 GB card's device pool), kept host
# pages' keys over PCIe (quest_host_keys="host") against from the int8 copy ("copy"), synchronous and launched,
# alternating; dense offload (the split path) as the peer, all in one process.
import sys, time
from dataclasses import replace
sys.path.insert(0, "bench")
import torch
from offload import ACTIVATION_GIB, CARD_GIB, random_prompts
from sparse import prefill_requests, HERE
from nanovllm import LLM
from nanovllm.layers.block_selector import DenseSelector

config = str(HERE / "configs" / "llama-3.1-8b")
context = 130560
block_bytes = 32 * 2 * 256 * 8 * 128 * 2
weights = 16.06e9
device_blocks = int((CARD_GIB - weights / 2**30 - ACTIVATION_GIB) * 2**30 // block_bytes)
host_blocks = (context + 320) // 256 + 8 - device_blocks
llm = LLM(config, load_format="dummy", max_model_len=131072, sparse_policy="quest", quest_token_budget=2048,
          num_gpu_blocks=device_blocks, enable_cpu_offload=True, cpu_kv_cache_gb=host_blocks * block_bytes / 2**30,
          quest_host_keys="copy")
selector = llm.runner.worker.selector
ids = prefill_requests(llm, random_prompts(128256, 1, context, 7), 8)

def timed(steps: int) -> float:
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3

results = {}
for rep in range(2):
    for keys in ("host", "copy"):
        selector.copied_host_keys = keys == "copy"
        llm.runner.recapture_decode_graphs()
        for launched in (False, True):
            llm.config = replace(llm.config, async_scheduling=launched)
            ms = timed(24)
            results.setdefault((keys, launched), []).append(ms)
            print(f"rep {rep} host keys {keys} async={launched}: {ms:.2f} ms/step", flush=True)
llm.config = replace(llm.config, async_scheduling=False)
llm.step()
llm.runner.set_block_selector(DenseSelector())
llm.runner.staged_decode = False
dense = timed(6)
print(f"dense offload: {dense:.1f} ms/step", flush=True)
for (keys, launched), v in results.items():
    print(f"host keys {keys} async={launched}: best {min(v):.2f} ms = {dense / min(v):.1f}x dense offload")
