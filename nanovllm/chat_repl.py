"""`nanovllm chat`: a multi-turn terminal chat that prints tokens as the engine produces them."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from nanovllm.llm import LLM, Message
from nanovllm.sampling_params import SamplingParams

HELP = "commands: /exit (or Ctrl-D) quits, /reset clears the conversation, Ctrl-C stops a reply"


def chat_loop(llm: LLM, params: SamplingParams, system: str | None = None,
              read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> list[Message]:
    """Read a line, stream the reply, repeat; returns the conversation when the user quits."""
    start: list[Message] = [{"role": "system", "content": system}] if system else []
    history = list(start)
    print(HELP, file=out, flush=True)
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            print(file=out)
            return history
        if line in ("/exit", "/quit"):
            return history
        if line == "/reset":
            history = list(start)
            continue
        if not line:
            continue
        reply = stream_reply(llm, [*history, {"role": "user", "content": line}], params, out)
        if reply is not None:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


def stream_reply(llm: LLM, conversation: list[Message], params: SamplingParams, out: TextIO) -> str | None:
    """Generate one reply, printing text as it is released; None if the engine refused the conversation."""
    try:
        request_id = llm.add_request(llm.chat_prompt(conversation), params)
    except ValueError as e:
        print(f"error: {e}", file=out, flush=True)
        return None
    shown = ""
    try:
        while llm.has_unfinished_requests():
            for result in llm.step():
                if result.request_id != request_id:
                    continue
                # the final text is decoded from all tokens at once; print only what extends what is shown
                if result.text.startswith(shown):
                    print(result.text[len(shown):], end="", file=out, flush=True)
                    shown = result.text
    except KeyboardInterrupt:
        llm.abort_request(request_id)
        print(" [stopped]", end="", file=out)
    print(file=out, flush=True)
    return shown
