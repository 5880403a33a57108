"""The command line: every subcommand documents every option; `nanovllm chat` streams a piped conversation."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from nanovllm.cli import build_parser

COMMANDS = ["fetch", "generate", "chat", "serve", "bench", "ruler"]


def subparsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from subparsers(sub, (*prefix, name))


def test_every_option_of_every_command_has_help():
    found = dict(subparsers(build_parser()))
    assert {c for (c, *_) in found} >= set(COMMANDS) and ("bench", "serving") in found
    for path, parser in found.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and not action.help.startswith(" (default"), (path, action.dest)
        assert parser.format_help().startswith("usage: nanovllm")  # what --help prints; formats every help string


def test_serve_help_runs():
    result = subprocess.run([sys.executable, "-m", "nanovllm.cli", "serve", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "--max-pending-requests" in result.stdout, result.stderr


@pytest.mark.slow
def test_chat_streams_a_piped_conversation(smollm2_path):
    from nanovllm import LLM, SamplingParams

    question = "What is the capital of France?"
    stdin = f"{question}\n/reset\n\n{question}\n/exit\nnot read\n"
    result = subprocess.run(
        [sys.executable, "-m", "nanovllm.cli", "chat", "--model", str(smollm2_path), "--max-tokens", "12",
         "--dtype", "float32", "--kvcache-block-size", "16", "--num-gpu-blocks", "32"],
        input=stdin, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    llm = LLM(str(smollm2_path), dtype="float32", kvcache_block_size=16, num_gpu_blocks=32)
    want = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=12),
                    use_tqdm=False)[0].text
    replies = result.stdout.split(">>> ")[1:]
    # /reset cleared the history, so the second answer equals the first; empty lines are skipped
    assert [r.strip() for r in replies] == [want.strip(), "", "", want.strip(), ""], result.stdout
