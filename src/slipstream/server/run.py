"""Run the app under uvicorn (what `slipstream serve` calls).

The socket is bound first (a port in use fails at once, in one line), uvicorn serves from a
thread of its own, and the model loads in the main thread meanwhile: /health answers 503
`{"status": "loading"}` until the model is attached, then 200. A banner on stderr says what is
served where. Ctrl-C (or SIGTERM) during the load or after it stops the server cleanly.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ..errors import SlipstreamError
from .app import COMPLETION_DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS, create_app, \
    default_max_tokens
from .limits import DEFAULT_MAX_BODY

STOP_TIMEOUT_S = 10  # uvicorn's graceful shutdown cuts open streams after 3 s


def run_server(model=None, host: str = "127.0.0.1", port: int = 8080, max_queue: int = 16,
               log_level: str = "info", spec_nodes: int | None = None,
               spec_depth: int | None = None, *, load: Callable[[], object] | None = None,
               max_tokens_default: int = DEFAULT_MAX_TOKENS,
               max_body: int = DEFAULT_MAX_BODY, console: Console | None = None,
               template_fallback: bool = False) -> None:
    """Serve `model`, or the model `load()` returns (loaded while the server already answers
    /health), until interrupted. Blocks; KeyboardInterrupt (Ctrl-C) and SystemExit (SIGTERM,
    exit status 143) propagate after the server has stopped. spec_nodes, spec_depth,
    max_tokens_default, max_body, template_fallback: see create_app."""
    if (model is None) == (load is None):
        raise TypeError("run_server needs a model or a load function, not both")
    console = console or Console(stderr=True)
    sock = bind(host, port)
    url = http_url(host, sock.getsockname()[1])
    app = create_app(model, max_queue=max_queue, spec_nodes=spec_nodes, spec_depth=spec_depth,
                     max_tokens_default=max_tokens_default, max_body=max_body,
                     template_fallback=template_fallback)
    # Open streams would hold a graceful shutdown forever; cut them after a few seconds.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=3)
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
    # uvicorn handles signals only in the main thread, which is busy loading: SIGTERM ends
    # the process as a SystemExit there, which stops the server below
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    loaded = None
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
        console.print(banner(model, url, max_queue, max_tokens_default, load_s, max_body))
        if load is not None:
            app.state.attach(model)
        while not stopped.wait(0.5):
            pass
    finally:
        server.should_exit = True
        stopped.wait(STOP_TIMEOUT_S)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if stopped.is_set():
            sock.close()  # uvicorn closed it already, unless it never started
            if loaded is not None:
                loaded.close()


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


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
           load_s: float | None = None, max_body: int = DEFAULT_MAX_BODY) -> Panel:
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
            ("max body", f"{_size(max_body)} per request, then 413")]
    if draft is not None:
        rows.append(("draft", Path(draft.path).name))
    if load_s is not None:
        rows.append(("loaded in", f"{load_s:.1f} s"))
    rows += [("API", f"{url}/v1"), ("health", f"{url}/health"), ("metrics", f"{url}/metrics")]
    for key, value in rows:
        t.add_row(key, value)
    return Panel(t, title="slipstream serve", title_align="left", expand=False)


__all__ = ["COMPLETION_DEFAULT_MAX_TOKENS", "DEFAULT_MAX_BODY", "banner", "bind", "run_server"]
