"""Engine prefill: first vs repeated 32K (new random prompts each), then new lengths (new cuDNN shapes)."""
import sys, time, torch
sys.path.insert(0, "bench")
from common import HERE
from nanovllm import LLM, SamplingParams
llm = LLM(str(HERE / "configs" / "llama-3.1-8b"), load_format="dummy", max_model_len=32768 + 64, max_num_seqs=1)
print(f"start-up {llm.startup_seconds:.1f} s", flush=True)
def once(n):
    p = torch.randint(0, 32000, (n,)).tolist()
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate([p], SamplingParams(max_tokens=1), use_tqdm=False); torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)
for n in (32768, 32768, 32768, 31000, 31000, 30000, 5000, 5000, 3000):
    print(f"prefill {n}: {once(n):.1f} ms", flush=True)
