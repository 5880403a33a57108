# One 128K prefill (random weights, 8B shape) through the XAttention engine at chunks of 32,768, under
# torch.profiler after an untimed run: where the time beyond GEMMs and the block-sparse kernel goes.
import sys, time
sys.path.insert(0, "bench")
import torch
from torch.profiler import ProfilerActivity, profile
from common import HERE
from offload import random_prompts
from nanovllm import LLM, SamplingParams

config = str(HERE / "configs" / "llama-3.1-8b")
context = 131071
llm = LLM(config, load_format="dummy", sparse_policy="xattention", sparse_min_context=0, xattn_threshold=0.2,
          xattn_cover="group", enable_prefix_caching=False, max_model_len=131072, max_num_seqs=1,
          num_gpu_blocks=131072 // 256 + 2, max_num_batched_tokens=32768)
prompt = random_prompts(128256, 1, context, context)[0]
first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
for _ in range(2):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = llm.generate([prompt], first, use_tqdm=False)[0]
    torch.cuda.synchronize(); print(f"xattention 128K prefill {time.perf_counter() - t:.2f} s, density "
                                    f"{out.metrics.prefill_density:.3f}", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
events = [e for e in prof.events() if e.device_type.name == "CUDA"]
print(f"profiled: wall {wall:.2f} s, kernels {sum(e.device_time for e in events) / 1e6:.2f} s ({len(events)} kernels)")
print(prof.key_averages().table(sort_by="device_time_total", row_limit=28, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
