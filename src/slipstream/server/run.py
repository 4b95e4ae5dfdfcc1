"""Run the app under uvicorn (what `slipstream serve` calls).

The socket is bound first (a port in use fails at once, in one line), uvicorn serves from a
thread of its own, and the model loads in the main thread meanwhile: /health answers 503
`{"status": "loading"}` until the model is attached, then 200. A banner on stderr says what is
served where.

Stopping: SIGTERM (what `docker stop`, systemd and Kubernetes send) stops accepting connections
at once, gives open requests `shutdown_timeout` seconds to finish, then ends those still open
cleanly: a stream gets an error event (code "server_shutting_down") and `data: [DONE]`, a
non-streamed request a 503; the process then exits with status 0. Before this, uvicorn cut open
streams 3 s after SIGTERM with no `[DONE]` and no chunked terminator, and the process exited
143. Ctrl-C does the same with no grace period: open requests end at once, just as cleanly.
SIGTERM during the model's load stops the load (the exit status is 0 too).
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import uvicorn
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ..errors import SlipstreamError
from .access import allowed_hosts
from .app import COMPLETION_DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS, create_app, \
    default_max_tokens
from .limits import DEFAULT_MAX_BODY

DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0  # docker stop and Kubernetes wait 10 and 30 s before SIGKILL
# after end_requests: the ended streams write their last two events and close (milliseconds on
# loopback); uvicorn cancels whatever is still open past this, and the worker thread stops
END_MARGIN_S = 3.0
WORKER_STOP_S = 5.0  # worker.stop's join: one token (or prefill chunk) of the running job


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM: leaves the wait (or the model's load) for the
    graceful stop. A SystemExit, so no `except Exception` in the load swallows it."""

    def __init__(self) -> None:
        super().__init__(0)


def run_server(model=None, host: str = "127.0.0.1", port: int = 8080, max_queue: int = 16,
               log_level: str = "info", spec_nodes: int | None = None,
               spec_depth: int | None = None, *, load: Callable[[], object] | None = None,
               max_tokens_default: int = DEFAULT_MAX_TOKENS,
               max_body: int = DEFAULT_MAX_BODY, console: Console | None = None,
               template_fallback: bool = False, api_key: str | None = None,
               allowed_host: Sequence[str] = (),
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Serve `model`, or the model `load()` returns (loaded while the server already answers
    /health), until interrupted. Blocks; returns after SIGTERM once the server has stopped
    (see the module's docstring); KeyboardInterrupt (Ctrl-C) propagates after it has stopped.
    spec_nodes, spec_depth, max_tokens_default, max_body, template_fallback, api_key: see
    create_app. allowed_host: Host names answered beside `host` and the loopback names ("*":
    any)."""
    if (model is None) == (load is None):
        raise TypeError("run_server needs a model or a load function, not both")
    if not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise ValueError(f"shutdown_timeout={shutdown_timeout} is invalid: must be a finite "
                         f"number >= 0")
    console = console or Console(stderr=True)
    sock = bind(host, port)
    url = http_url(host, sock.getsockname()[1])
    app = create_app(model, max_queue=max_queue, spec_nodes=spec_nodes, spec_depth=spec_depth,
                     max_tokens_default=max_tokens_default, max_body=max_body,
                     template_fallback=template_fallback, api_key=api_key,
                     allowed_hosts=allowed_hosts(host, allowed_host))
    # uvicorn's own cut is only the backstop: end_requests ends open requests cleanly first
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + END_MARGIN_S)
    if log_level == "info":
        # the banner says what uvicorn's start and stop lines would; access logs stay
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = uvicorn.Server(config)
    # waited on with an Event: a Thread.join that Ctrl-C interrupts leaves the thread marked as
    # stopped while it still runs (CPython's bpo-45274 handling), so later joins return at once
    stopped = threading.Event()

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            stopped.set()

    thread = threading.Thread(target=serve, name="slipstream-http", daemon=True)
    main = threading.current_thread() is threading.main_thread()
    # uvicorn handles signals only in the main thread, which is busy loading or waiting here:
    # SIGTERM raises Terminated there, which stops the server below
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    loaded = None
    grace = 0.0  # Ctrl-C or an error: open requests end at once
    try:
        thread.start()
        while not server.started:
            if stopped.is_set():
                raise SlipstreamError(f"the HTTP server on {url} stopped while starting (its "
                                      f"log is above)")
            time.sleep(0.02)
        if load is not None:
            console.print(f"[dim]listening on {url}; loading the model (GET /health answers "
                          f"503 until it is ready)[/dim]", highlight=False, soft_wrap=True)
            t0 = time.perf_counter()
            model = loaded = load()
            load_s = time.perf_counter() - t0
        else:
            load_s = None
        console.print(banner(model, url, max_queue, max_tokens_default, load_s, max_body,
                             api_key is not None))
        if load is not None:
            app.state.attach(model)
        while not stopped.wait(0.5):
            pass
    except Terminated:
        grace = shutdown_timeout
    finally:
        if previous is not None:  # a SIGTERM now must not break the stop itself
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop(server, app, stopped, grace, console)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if stopped.is_set():
            sock.close()  # uvicorn closed it already, unless it never started
            if loaded is not None:
                loaded.close()


def stop(server: uvicorn.Server, app, stopped: threading.Event, grace: float,
         console: Console) -> None:
    """Stop accepting, give open requests `grace` seconds, end those left, wait for uvicorn."""
    if grace > 0 and not stopped.is_set():
        console.print(f"[dim]stopping: open requests have {grace:g} s to finish[/dim]",
                      highlight=False)
    server.should_exit = True  # uvicorn closes the listening socket at its next tick (0.1 s)
    stopped.wait(grace)  # sooner when every connection has closed
    if not stopped.is_set():
        app.state.end_requests()
    stopped.wait(END_MARGIN_S + WORKER_STOP_S + 1.0)


def _terminate(signum, frame) -> None:
    # once only: a second SIGTERM while stopping must not break the stop itself (the finally
    # clause above); the first one's grace period still bounds the exit
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (listening is uvicorn's), or one line saying why not."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise SlipstreamError(f"cannot listen on {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = "; another server may be running there: choose another --port" if \
            e.errno in (98, 48) else ""  # EADDRINUSE on Linux, macOS
        raise SlipstreamError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def banner(model, url: str, max_queue: int, max_tokens_default: int = DEFAULT_MAX_TOKENS,
           load_s: float | None = None, max_body: int = DEFAULT_MAX_BODY,
           api_key: bool = False) -> Panel:
    """What is served where: the model, device, context, request defaults and URLs."""
    chat, completions = default_max_tokens(max_tokens_default, model.ctx)
    device = str(model.device)
    torch = sys.modules.get("torch")
    if model.device.type == "cpu" and torch is not None:
        n = torch.get_num_threads()
        device += f", {n} thread{'s' if n > 1 else ''}"
    draft = getattr(model, "draft", None)
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    rows = [("model", f"{Path(model.path).name} (id {Path(model.path).stem!r} or 'default')"),
            ("device", device),
            ("context", f"{model.ctx} tokens"),
            ("max_tokens", f"{chat} when a request sets none"
                           + (f" ({completions} on /v1/completions)" if completions != chat
                              else "")),
            ("queue", f"{max_queue} waiting requests, then 503"),
            ("max body", f"{_size(max_body)} per request, then 413"),
            ("API key", "required (Bearer), except /health and the chat page" if api_key
             else "none (--api-key sets one)")]
    if draft is not None:
        rows.append(("draft", Path(draft.path).name))
    if load_s is not None:
        rows.append(("loaded in", f"{load_s:.1f} s"))
    rows += [("API", f"{url}/v1"), ("health", f"{url}/health"), ("metrics", f"{url}/metrics")]
    for key, value in rows:
        t.add_row(key, value)
    return Panel(t, title="slipstream serve", title_align="left", expand=False)


__all__ = ["COMPLETION_DEFAULT_MAX_TOKENS", "DEFAULT_MAX_BODY", "banner", "bind", "run_server"]
