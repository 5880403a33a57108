"""The server's per-token text work on one long stream (the detokenizer thread's OutputText.add and match_stop,
then the handler's Choices.delta), the tree TREE's code: CPU us per token over the first N tokens and the last
1,000 of N, SmolLM2's tokenizer, random token ids, two stop strings that never occur.
Usage: PYTHONPATH=TREE python stop_scan_ab.py TOKENIZER_DIR N"""
import random
import sys
import time
from types import SimpleNamespace

from transformers import AutoTokenizer

from nanovllm.engine.detokenizer import OutputText
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.server import responses as r
from nanovllm.server.prefix import Prefix

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
n = int(sys.argv[2])
rng = random.Random(0)
ids = [rng.randrange(100, 40000) for _ in range(n)]
stops = ["\u2603\u2603\u2603", "<|never|>"]
text = OutputText(tokenizer, [1, 2, 3, 4], stops)
parsed = SimpleNamespace(n=1, params=SimpleNamespace(stop=stops), logprobs=None, echo=False)
choices = r.Choices(SimpleNamespace(parsed=parsed, prompts=[SimpleNamespace(text="")]), False, r.TokenTexts(None))
marks, sent = [], 0
started = time.process_time()
for k, token in enumerate(ids):
    text.add(token)
    assert not text.match_stop()
    out = RequestOutput("r", None, [1], [CompletionOutput(0, text.text, Prefix(ids, k + 1), None)], False)
    sent += len(choices.delta(0, out)[0])
    marks.append(time.process_time())
last = (marks[-1] - marks[-1001]) / 1000
print(f"{r.__file__.rsplit('/nanovllm/', 1)[0]}: {1e6 * (marks[-1] - started) / n:.1f} us/token over {n} tokens, {1e6 * last:.1f} us/token "
      f"over the last 1,000 (text {len(text.text):,} chars, {sent:,} sent)")
