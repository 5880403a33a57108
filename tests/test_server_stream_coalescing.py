"""A request's stream keeps only its newest output, so a consumer that falls behind sends one SSE chunk
carrying every token since its last one; and the chunk template writes what json.dumps of the chunk writes."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")

from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.server import responses as r
from nanovllm.server.async_engine import _ACCEPTED, RequestStream
from nanovllm.server.engine_loop import RequestFailed


def output(text: str, token_ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, token_ids, finish)], finish is not None)


def stream() -> RequestStream:
    return RequestStream("r", SimpleNamespace(_release=lambda request_id, abort: None))


def test_a_consumer_behind_gets_the_newest_output_and_the_end_is_never_replaced():
    async def run():
        s = stream()
        s.put(_ACCEPTED)
        await s.admitted()
        for k in range(1, 4):
            s.put(output("ab"[:k], list(range(k))))
        newest = await s.next()
        s.put(output("abcd", [0, 1, 2, 3], "length"))
        s.put(RequestFailed("too late"))  # after the end: dropped
        last = await s.next()
        return newest, last, s.finished

    newest, last, finished = asyncio.run(run())
    assert newest.token_ids == [0, 1, 2] and last.finish_reason == "length" and finished


def test_an_error_replaces_an_output_not_yet_taken_and_a_refusal_ends_admission():
    async def run():
        s = stream()
        s.put(_ACCEPTED)
        s.put(output("a", [0]))
        s.put(RequestFailed("step failed"))
        with pytest.raises(RequestFailed):
            await s.next()
        refused = stream()
        refused.put(ValueError("too long"))
        with pytest.raises(ValueError):
            await refused.admitted()
        return s.finished and refused.finished

    assert asyncio.run(run())


def test_a_coalesced_chunk_carries_the_concatenated_text_and_all_new_tokens():
    parsed = SimpleNamespace(n=1, params=SimpleNamespace(stop=[]), logprobs=None, echo=False)
    prepared = SimpleNamespace(parsed=parsed, prompts=[SimpleNamespace(text="")])
    choices = r.Choices(prepared, False, r.TokenTexts(None))
    assert choices.delta(0, output("Hello", [7])) == ("Hello", None, None, 1)
    assert choices.delta(0, output("Hello, world", [7, 8, 9])) == (", world", None, None, 2)  # two steps at once
    assert choices.delta(0, output("Hello, world!", [7, 8, 9, 10], "stop")) == ("!", "stop", None, 1)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text,finish,logprobs", [("héllo \"x\"\n\u2028", None, None), ("", "stop", {"tokens": ["a"]})])
def test_chunk_events_match_json_dumps_of_the_chunk(chat, text, finish, logprobs):
    events = r.ChunkEvents("cmpl-1", 'odd "model"', 5, chat)
    for index in (0, 3):
        made = events(index, text, finish, logprobs)
        assert made == r.event(r.chunk("cmpl-1", 'odd "model"', 5, chat, index, text, finish, logprobs))
        assert json.loads(made[6:])["choices"][0]["index"] == index


@pytest.mark.parametrize("stops", [[], ["xyz"]])
def test_streamed_deltas_add_up_to_the_final_text_with_the_stop_tail_held_back(stops):
    """Deltas of a text that grows a piece a step (held back by a stop string's length - 1 until the end) add up
    to the final text; none reaches past what the text held hold characters before."""
    parsed = SimpleNamespace(n=1, params=SimpleNamespace(stop=stops), logprobs=None, echo=False)
    choices = r.Choices(SimpleNamespace(parsed=parsed, prompts=[SimpleNamespace(text="")]), False, r.TokenTexts(None))
    pieces = [f"w{k} " for k in range(300)]
    sent, text = "", ""
    for k, piece in enumerate(pieces):
        text += piece
        delta, finish, _, new = choices.delta(0, output(text, list(range(k + 1)), "length" if k == 299 else None))
        sent += delta
        assert new == 1 and len(sent) <= (len(text) if finish else len(text) - choices.hold)
    assert sent == text and finish == "length"


def test_a_final_text_that_does_not_extend_the_streamed_one_adds_nothing():
    """The finished output's text is decoded anew (OutputText.final); where it is not the streamed text plus more
    (a tokenizer decoding a whole output unlike its pieces), nothing misplaced is sent."""
    parsed = SimpleNamespace(n=1, params=SimpleNamespace(stop=[]), logprobs=None, echo=False)
    choices = r.Choices(SimpleNamespace(parsed=parsed, prompts=[SimpleNamespace(text="")]), False, r.TokenTexts(None))
    assert choices.delta(0, output(" Hello", [7]))[0] == " Hello"
    assert choices.delta(0, output("Hello world", [7, 8], "stop"))[:2] == ("", "stop")
    again = r.Choices(SimpleNamespace(parsed=parsed, prompts=[SimpleNamespace(text="")]), False, r.TokenTexts(None))
    assert again.delta(0, output(" Hello", [7]))[0] == " Hello"
    assert again.delta(0, output(" Hello world", [7, 8], "stop"))[:2] == (" world", "stop")
