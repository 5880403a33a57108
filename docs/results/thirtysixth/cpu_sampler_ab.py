import os, time, torch
from nanovllm import LLM, SamplingParams
from nanovllm.layers import sampler
new = sampler._exponential
def old(shape, generator, device):
    return torch.empty(shape, device=device).exponential_(generator=generator)
llm = LLM(os.path.expanduser("~/.cache/nanovllm/smollm2-135m"), device="cpu", dtype="float32")
animals = ("cat", "dog", "fish", "robot", "tree", "cloud", "stone", "river")
prompts = [f"Write a short story about a {w} who learns to fly." for w in animals] * 2
params = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], params, use_tqdm=False)
for r in range(3):
    for name, fn in (("exponential_", old), ("rand+log", new)):
        sampler._exponential = fn
        t = time.perf_counter(); outs = llm.generate(prompts, params, use_tqdm=False); dt = time.perf_counter() - t
        print(f"{name:13s} {sum(len(o.token_ids) for o in outs) / dt:6.1f} tok/s", flush=True)
