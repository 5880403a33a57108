import os, time
from nanovllm import LLM, SamplingParams
path = os.path.expanduser("~/.cache/nanovllm/smollm2-135m")


def main():
    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:", "def fibonacci(n):",
               "Explain what a KV cache is in one sentence.", "The quick brown fox", "1, 2, 3, 5, 8,", "Translate 'good morning' to Spanish:"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs = {}
    for tp in (1, 2):
        llm = LLM(path, device="cpu", dtype="float32", tensor_parallel_size=tp)
        t = time.perf_counter(); outs[tp] = llm.generate(prompts, params, use_tqdm=False); dt = time.perf_counter() - t
        print(f"TP={tp}: {dt:.1f} s", flush=True)
        llm.shutdown(); del llm
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[1], outs[2]))
    worst = max(abs(a.outputs[0].logprobs[i][t] - b.outputs[0].logprobs[i][t]) for a, b in zip(outs[1], outs[2])
                for i, t in enumerate(a.token_ids) if i < len(b.token_ids) and t in b.outputs[0].logprobs[i])
    print(f"SmolLM2-135M fp32, 8 prompts x 32 greedy tokens: {same}/8 identical; largest logprob difference {worst:.2e}")


if __name__ == '__main__':
    main()
