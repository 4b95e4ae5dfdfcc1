"""`slipstream serve`: the OpenAI-compatible HTTP server (server/) over one model."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..errors import SlipstreamError
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
    add_draft_args(s)
    s.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    try:
        from ..server import run_server  # the `server` extra's packages, which may be absent
    except ImportError as e:
        raise SlipstreamError(f"the server needs its extra ({e.name or e} is missing): "
                              f"pip install 'slipstream[server]'") from None
    # the server listens first and answers /health ("loading") while the model loads
    from ..memory.budget import parse_size  # imports torch

    # private weights: a server must outlive its file being truncated or rewritten (SIGBUS)
    run_server(load=lambda: load_model(a, private_weights=True), host=a.host, port=a.port,
               max_queue=a.max_queue, max_tokens_default=a.max_tokens_default,
               max_body=parse_size(a.max_body), template_fallback=a.template_fallback,
               **spec_kwargs(a))
    return 0
