"""Command line: fetch, generate, chat, serve, bench, ruler, needle, ppl (engine options mirror LLM(...) keywords)."""
from __future__ import annotations

import argparse
import time

from nanovllm.engine_args import add_engine_options, engine_options, run_command
from nanovllm.log_setup import configure_logging
from nanovllm.server import HTTP_PARSERS, UVICORN_LOOPS

MODEL_HELP = ("HF-format model directory, a Hugging Face Hub id (org/name, downloaded into the hub cache) or "
              "smollm2-135m / qwen2.5-coder-0.5b (default: SmolLM2-135M-Instruct)")
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "List three prime numbers.",
]


def cmd_fetch(args: argparse.Namespace) -> None:
    from nanovllm.models.fetch import fetch_model

    print(fetch_model(args.name))


def cmd_generate(args: argparse.Namespace) -> None:
    from nanovllm import LLM

    started = time.perf_counter()
    llm = LLM(args.model, **engine_options(args))
    loaded = time.perf_counter()
    params = sampling_params(args, llm)
    prompts = args.prompt or DEFAULT_PROMPTS
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if not args.raw else \
        llm.generate(prompts, params)
    elapsed = time.perf_counter() - loaded
    device = llm.runner.device
    print(f"\nmodel {llm.config.model} on {device} ({llm.runner.dtype}), loaded in {loaded - started:.1f} s")
    for prompt, out in zip(prompts, outputs):
        ttft = out.metrics.time_to_first_token
        tpot = out.metrics.time_per_output_token
        print(f"\n> {prompt}\n{out.text.strip()}")
        print(f"  [{len(out.prompt_token_ids)} prompt + {len(out.token_ids)} output tokens, finish={out.finish_reason}, "
              f"TTFT {ttft * 1e3:.0f} ms, TPOT {(tpot or 0) * 1e3:.1f} ms]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {total} output tokens in {elapsed:.2f} s: {total / elapsed:.1f} output tokens/s")


def cmd_chat(args: argparse.Namespace) -> None:
    from nanovllm import LLM
    from nanovllm.chat_repl import chat_loop

    llm = LLM(args.model, **engine_options(args))
    params = sampling_params(args, llm)
    chat_loop(llm, params, system=args.system)


def cmd_serve(args: argparse.Namespace) -> None:
    from nanovllm import LLM
    from nanovllm import request_log
    from nanovllm.server.app import ServerOptions, api_key_from, check_api_server_count, load_chat_template, serve
    from nanovllm.server.engine_core import EngineProcess

    if args.model_option is not None and args.model is not None and args.model_option != args.model:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}")
    model = args.model if args.model is not None else args.model_option
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
    for flag in ("max_request_body_bytes", "timeout_keep_alive", "timeout_request_read"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    check_api_server_count(args.api_server_count, args.engine_core)
    request_log.enable(args.enable_log_requests)
    options = ServerOptions(args.served_model_name, args.max_pending_requests, api_key_from(args.api_key),
                            tuple(args.allowed_origins or ()), args.max_request_body_bytes, args.timeout_keep_alive,
                            args.timeout_request_read, load_chat_template(args.chat_template), args.api_server_count,
                            args.uvicorn_loop, args.uvicorn_http)
    if args.api_server_count > 1:
        serve_front_ends(model, args, options)
    elif args.engine_core == "process":
        llm = EngineProcess(model, args.enable_log_requests, **engine_options(args))
    else:
        llm = LLM(model, **engine_options(args))
    serve(llm, args.host, args.port, options, args.log_level, args.shutdown_timeout)


def serve_front_ends(model: str | None, args: argparse.Namespace, options) -> None:
    """`serve --api-server-count N` with N > 1: N front-end processes over one engine process."""
    import logging

    from nanovllm.server.api_servers import FrontEndSettings, serve_api_servers

    settings = FrontEndSettings(args.host, args.port, options, args.log_level,
                                logging.getLogger("nanovllm").getEffectiveLevel(), args.enable_log_requests,
                                args.shutdown_timeout)
    serve_api_servers(model, engine_options(args), settings)


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    model = "the model's generation_config.json (with --generation-config auto), else"
    parser.set_defaults(default_max_tokens=max_tokens)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"tokens to generate per reply (default: {model} {max_tokens})")
    parser.add_argument("--temperature", type=float, default=None, help=f"0 means greedy (default: {model} 0)")
    parser.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (default: {model} 1)")
    parser.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")


def sampling_params(args: argparse.Namespace, llm):
    """The command's flags over the model's sampling defaults (LLM.get_default_sampling_params) over the
    command's own (greedy, args.default_max_tokens)."""
    from nanovllm import SamplingParams

    given = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens,
             "seed": args.seed_request}
    own = {"temperature": 0.0, "max_tokens": args.default_max_tokens}
    return SamplingParams(**{**own, **llm.generation_defaults, **{k: v for k, v in given.items() if v is not None}})


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                           description="Serve a model over the OpenAI API with continuous batching. Routes: "
                                       "/v1/completions, /v1/chat/completions, /v1/models[/ID], /tokenize, "
                                       "/detokenize, /version, /health, /metrics.")
    serve.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    serve.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                       help="the model, as an option (as vLLM's serve accepts it)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, used instead of the model's own")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send and /v1/models lists (default: the model directory's name)")
    serve.add_argument("--max-pending-requests", type=int, default=256,
                       help="most requests in flight (running + waiting); one more gets 503; with several API "
                            "servers, per API server (default: 256)")
    serve.add_argument("--shutdown-timeout", type=float, default=None,
                       help="seconds to let requests in flight finish after SIGTERM; a second SIGTERM exits at "
                            "once (default: no limit)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
                            "(default: $NANOVLLM_API_KEY, else no key; prefer the variable: arguments are visible to "
                            "other local users)")
    serve.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="origins (e.g. https://app.example.com, or *) whose web pages may call the API (CORS) "
                            "(default: none)")
    serve.add_argument("--max-request-body-bytes", type=int, default=32 * 1024 * 1024,
                       help="larger request bodies get 413 (default: 33554432, 32 MiB)")
    serve.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open (default: 5)")
    serve.add_argument("--timeout-request-read", type=float, default=30.0,
                       help="seconds within which a request's line and headers, and then its body, must arrive; "
                            "slower clients are disconnected, or get 408 for the body (default: 30)")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log one line per request: its id, prompt length and sampling parameters (default: off)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn log level (default: info)")
    serve.add_argument("--engine-core", default="process", choices=["process", "thread"],
                       help="where the engine loop runs: in a process of its own, apart from the HTTP front end "
                            "and the detokenizer (as vLLM's EngineCore), or in a thread of the server process "
                            "(default: process)")
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="HTTP front-end processes sharing the listening socket and one engine process (needs "
                            "--engine-core process); each tokenizes, detokenizes and streams its own requests, and "
                            "its /metrics counts its own requests beside the engine's gauges (default: 1)")
    serve.add_argument("--uvicorn-loop", default="auto", choices=UVICORN_LOOPS,
                       help="the front end's event loop (default: auto, uvloop where installed)")
    serve.add_argument("--uvicorn-http", default="auto", choices=HTTP_PARSERS,
                       help="the front end's HTTP parser (default: auto, httptools where installed; h11 is pure "
                            "Python and costs more CPU per streamed token)")
    add_engine_options(serve)
    serve.set_defaults(func=cmd_serve)


def add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens as they are generated",
                          description="Interactive multi-turn chat through the model's chat template. "
                                      "Type /exit or press Ctrl-D to quit, /reset to clear the history.")
    chat.add_argument("--model", default=None, help=MODEL_HELP)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    add_sampling_options(chat, 256)
    add_engine_options(chat)
    chat.set_defaults(func=cmd_chat)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="install a default model and print its directory")
    fetch.add_argument("name", choices=["smollm2-135m", "qwen2.5-coder-0.5b"], help="which default model to install")
    fetch.set_defaults(func=cmd_fetch)
    gen = sub.add_parser("generate", help="generate for a few prompts and print outputs and timings")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: four examples)")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text instead of through the chat template")
    add_sampling_options(gen, 64)
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)
    add_chat_parser(sub)
    add_serve_parser(sub)
    from nanovllm.serving_bench import add_bench_parser

    add_bench_parser(sub)
    from nanovllm.eval.ruler.run import add_ruler_parser

    add_ruler_parser(sub)
    from nanovllm.eval.needle import add_needle_parser

    add_needle_parser(sub)
    from nanovllm.eval.ppl import add_ppl_parser

    add_ppl_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging()
    run_command(args.func, args)


if __name__ == "__main__":
    main()
