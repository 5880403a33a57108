"""The offline entry point: LLM(...).generate(...) and .chat(...), as in vLLM.

generate() and chat() may be called from several threads: calls run one after another (a lock).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence as SequenceABC

from tqdm.auto import tqdm

from nanovllm import validation
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM(LLMEngine):
    def __init__(self, model: str | None = None, **options):
        super().__init__(model, **options)
        self._generate_lock = threading.Lock()

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for all prompts as one continuously batched workload; outputs keep prompt order.

        prompts: a str, a list of int token ids, or a list/tuple of those (anything else: TypeError).
        A request whose prompt + max_tokens exceeds max_model_len runs and stops at max_model_len with
        finish_reason "length" (as vLLM's offline LLM does; the server refuses it instead)."""
        prompts = validation.prompts(prompts)
        params = _as_params_list(sampling_params, len(prompts), self.get_default_sampling_params)
        token_ids = [self.tokenize(p) for p in prompts]
        for ids, sp in zip(token_ids, params):
            self.check_request(ids, sp)  # refuse a bad batch before any of it runs
        with self._generate_lock:
            request_ids = [self.add_request(ids, sp) for ids, sp in zip(token_ids, params)]
            for rid, prompt in zip(request_ids, prompts):
                if isinstance(prompt, str):
                    self.requests[rid].prompt = prompt
            try:
                finished = self._run_to_completion(set(request_ids), use_tqdm)
            finally:
                for rid in request_ids:
                    self.abort_request(rid)  # no-op for finished ones; cleans up after an interrupt
        return [finished[rid] for rid in request_ids]

    def _run_to_completion(self, request_ids: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until every request finished. The bar counts completions (n per request) and, as vLLM's,
        estimates input (prompt tokens, once per completion) and output tokens per second."""
        finished: dict[str, RequestOutput] = {}
        total = sum(len(self.requests[rid].samples) for rid in request_ids)
        bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm, postfix=_speed(0, 0, 1.0))
        tokens_in = tokens_out = 0
        with bar:
            while len(finished) < len(request_ids):
                for req in self._step(final_only=True):
                    if req.finished and req.request_id in request_ids:
                        out = req.output()
                        finished[req.request_id] = out
                        tokens_in += len(out.prompt_token_ids) * len(out.outputs)
                        tokens_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.postfix = _speed(tokens_in, tokens_out, bar.format_dict["elapsed"])
                        bar.update(len(out.outputs))
        return finished

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's own chat template to each conversation, then generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[Message]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _speed(tokens_in: int, tokens_out: int, elapsed: float) -> str:
    elapsed = max(elapsed, 1e-9)
    return f"est. speed input: {tokens_in / elapsed:.2f} toks/s, output: {tokens_out / elapsed:.2f} toks/s"


def _as_params_list(params, n: int, default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError("sampling_params must be None, a SamplingParams or a list/tuple of SamplingParams, "
                        f"got {type(params).__name__}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
