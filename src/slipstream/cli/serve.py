"""`slipstream serve`: the OpenAI-compatible HTTP server (server/) over one model."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .. import envs
from ..errors import BadArgument, SlipstreamError
from .loading import load_model
from .options import add_draft_args, add_model_args, spec_kwargs


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    s = command("serve", "OpenAI-compatible HTTP server (/v1/chat/completions, ...)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait while one "
                   "generates; more get 503 with Retry-After")
    s.add_argument("--max-tokens-default", type=int, default=512, metavar="N",
                   help="tokens a request that sets no max_tokens generates at most (-1: "
                   "until the context is full; /v1/completions keeps OpenAI's 16 where that "
                   "is fewer); a max_tokens above the context is refused with a 400")
    s.add_argument("--max-body", default="4MiB", metavar="SIZE", help="the largest request "
                   "body accepted; a larger one gets a 413 before it is read")
    s.add_argument("--template-fallback", action="store_true", help="serve plain ChatML "
                   "where the model's chat template cannot render a typical conversation "
                   "(checked at start); without it, such a model's chat requests get a 500")
    s.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on "
                   "every endpoint but /health and the chat page (401 otherwise); default "
                   "$SLIPSTREAM_API_KEY, which, unlike this flag, other users' `ps` cannot see")
    s.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name the server answers besides the bound address, localhost, "
                   "127.0.0.1 and ::1 (repeatable; '*': any; default: those alone); other "
                   "Hosts get a 400, which stops DNS-rebinding pages")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, seconds open requests get to finish; those still open "
                   "then end with an error event and [DONE] (a 503 if not streamed), and the "
                   "server exits 0")
    add_draft_args(s)
    s.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    try:
        from ..server import run_server  # the `server` extra's packages, which may be absent
    except ImportError as e:
        raise SlipstreamError(f"the server needs its extra ({e.name or e} is missing): "
                              f"pip install 'slipstream[server]'") from None
    api_key = a.api_key if a.api_key is not None else envs.get("SLIPSTREAM_API_KEY")
    if api_key is not None and not api_key.strip():
        raise BadArgument("--api-key is empty: give a key, or leave the option out to serve "
                          "without one")
    if not (math.isfinite(a.shutdown_timeout) and a.shutdown_timeout >= 0):
        raise BadArgument(f"--shutdown-timeout {a.shutdown_timeout} is invalid: give a number "
                          f"of seconds >= 0")
    # the server listens first and answers /health ("loading") while the model loads
    from ..memory.budget import parse_size  # imports torch

    # private weights: a server must outlive its file being truncated or rewritten (SIGBUS)
    run_server(load=lambda: load_model(a, private_weights=True), host=a.host, port=a.port,
               max_queue=a.max_queue, max_tokens_default=a.max_tokens_default,
               max_body=parse_size(a.max_body), template_fallback=a.template_fallback,
               api_key=api_key, allowed_host=a.allowed_host,
               shutdown_timeout=a.shutdown_timeout,
               **spec_kwargs(a))
    return 0
