# Where an async (launched) narrowed offload step waits for the device: torch's sync debug mode over launched
# steps of Quest's default (int8 key copy, pages) at 1 x 128K, the 8B shape, a 24 GB card's device pool.
import sys, time, traceback, warnings
from collections import Counter
from dataclasses import replace
sys.path.insert(0, "bench")
import torch
from offload import ACTIVATION_GIB, CARD_GIB, random_prompts
from sparse import prefill_requests, HERE
from nanovllm import LLM

config = str(HERE / "configs" / "llama-3.1-8b")
context = 130560
block_bytes = 32 * 2 * 256 * 8 * 128 * 2
weights = 16.06e9
device_blocks = int((CARD_GIB - weights / 2**30 - ACTIVATION_GIB) * 2**30 // block_bytes)
host_blocks = (context + 320) // 256 + 8 - device_blocks
llm = LLM(config, load_format="dummy", max_model_len=131072, sparse_policy="quest", quest_token_budget=2048,
          num_gpu_blocks=device_blocks, enable_cpu_offload=True, cpu_kv_cache_gb=host_blocks * block_bytes / 2**30)
ids = prefill_requests(llm, random_prompts(128256, 1, context, 7), 64)
for launched in (False, True, False, True):
    llm.config = replace(llm.config, async_scheduling=launched)
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(24):
        llm.step()
    torch.cuda.synchronize()
    print(f"async={launched}: {(time.perf_counter() - t0) / 24 * 1e3:.2f} ms/step", flush=True)
llm.config = replace(llm.config, async_scheduling=True)
sites = Counter()
def show(message, category, filename, lineno, file=None, line=None):
    stack = [f for f in traceback.extract_stack()[:-1] if "nanovllm" in f.filename]
    sites[(str(message)[:80], " <- ".join(f"{f.filename.split('nanovllm/')[-1]}:{f.lineno}" for f in stack[-4:]))] += 1
warnings.showwarning = show
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode(1)
for _ in range(6):
    llm.step()
torch.cuda.set_sync_debug_mode(0)
for (message, where), n in sites.most_common(20):
    print(f"{n:3d} x {message} at {where}")
# the step's host time alone: profile python on a few launched steps
import cProfile, pstats, io
pr = cProfile.Profile()
pr.enable()
for _ in range(8):
    llm.step()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue())
