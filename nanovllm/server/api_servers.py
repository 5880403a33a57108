"""`nanovllm serve --api-server-count N`: N HTTP front-end processes over one engine process (vLLM's
--api-server-count).

This process binds the listening socket once, starts the engine process (engine_core.SharedCore, one pair of
pipes per front end) and N front-end processes, each handed the socket and its own pair. Each front end is a
whole server (app.serve: HTTP, tokenizer, detokenizer, /metrics) over a CoreClient; the kernel gives each new
connection to whichever front end accepts it first. This process then only supervises:

- SIGTERM/SIGINT: each front end gets a SIGTERM and drains its requests; the last to stop lets the engine
  process end; a second signal makes them exit at once. Exit status 0.
- A front end that dies: the engine process aborts its requests (their KV freed) and the others go on.
- The engine process dying: every front end reports it (503, error events) and exits 1; so does this process.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from nanovllm.server.app import ServerOptions, serve
from nanovllm.server.engine_core import CoreClient, CoreStart, Link, SharedCore, name_process

log = logging.getLogger("nanovllm.server")

STOP_TIMEOUT_S = 60.0  # for the engine process to end after the last front end stopped


@dataclass(frozen=True)
class FrontEndSettings:
    """What each front-end process is started with, besides its link and the socket."""

    host: str
    port: int
    options: ServerOptions
    log_level: str
    logger_level: int  # the "nanovllm" logger's level
    log_requests: bool
    shutdown_timeout: float | None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound and listening, as uvicorn makes one (raises OSError, e.g. the address in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve_api_servers(model: str | None, engine_options: dict, settings: FrontEndSettings) -> None:
    """Run settings.options.api_server_count front ends over one engine process until a signal, then drain;
    exits 1 if the engine process failed or every front end went away unasked."""
    try:
        sock = listening_socket(settings.host, settings.port)
    except OSError as e:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        sys.exit(1)
    core = SharedCore(model, settings.options.api_server_count, settings.log_requests, **engine_options)
    front_ends = [start_front_end(k, link, core.start, sock, settings) for k, link in enumerate(core.links)]
    core.release_links()
    sock.close()
    log.info("%d API servers (pids %s) on http://%s:%d, engine process pid %d", len(front_ends),
             ", ".join(str(p.pid) for p in front_ends), settings.host, settings.port, core.process.pid)
    sys.exit(Supervisor(core, front_ends).run())


def start_front_end(index: int, link: Link, start: CoreStart, sock: socket.socket,
                    settings: FrontEndSettings) -> BaseProcess:
    process = multiprocessing.get_context("spawn").Process(
        target=_front_end_main, name=f"nanovllm-api-{index}", args=(link, start, sock, settings))
    process.start()
    return process


def _front_end_main(link: Link, start: CoreStart, sock: socket.socket, settings: FrontEndSettings) -> None:
    from nanovllm import request_log
    from nanovllm.log_setup import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process: the parent sends a SIGTERM
    configure_logging()
    logging.getLogger("nanovllm").setLevel(settings.logger_level)
    request_log.enable(settings.log_requests)
    client = CoreClient(link, start)
    name_process("nanovllm-api")  # once about to serve: `bench serving` waits for every front end so named
    serve(client, settings.host, settings.port, settings.options, settings.log_level, settings.shutdown_timeout,
          sock=sock)


class Supervisor:
    """Waits for the front ends and the engine process; forwards SIGTERM/SIGINT to the front ends as SIGTERM."""

    def __init__(self, core: SharedCore, front_ends: list[BaseProcess]):
        self.core = core
        self.front_ends = front_ends
        self.signalled = False

    def run(self) -> int:
        """The exit status: 1 if the engine process failed or the front ends all ended unasked, else 0."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        alive = list(self.front_ends)
        core_running, core_failed = True, False
        while alive:
            watched = [p.sentinel for p in alive] + ([self.core.process.sentinel] if core_running else [])
            ready = wait(watched)
            if core_running and self.core.process.sentinel in ready:
                core_running = False
                self.core.process.join()
                # after a signal the engine process ends with 0 once the last front end stopped, which may be
                # before that front end's own exit; any other end is a failure
                core_failed = self.core.process.exitcode != 0 or not self.signalled
                if core_failed:
                    log.error("the engine process exited with code %s; the front ends exit", self.core.process.exitcode)
            for process in [p for p in alive if p.sentinel in ready]:
                alive.remove(process)
                self._ended(process, core_failed)
        self.core.join(STOP_TIMEOUT_S)
        return 1 if core_failed or not self.signalled else 0

    def _ended(self, process: BaseProcess, core_failed: bool) -> None:
        process.join()
        if process.exitcode != 0 and not self.signalled and not core_failed:
            log.error("API server %s (pid %d) exited with code %s; its requests were aborted, the others go on",
                      process.name, process.pid, process.exitcode)

    def _on_signal(self, sig: int, frame) -> None:
        self.signalled = True
        for process in self.front_ends:
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
