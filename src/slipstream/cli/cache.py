"""`slipstream list` and `slipstream rm`: the models in the cache."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import ModelNotFound
from ..hub.store import cache_dir, find, list_models, partials, remove
from .render import err


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    ls = command("list", "the models in the cache: name, size, source, path")
    ls.set_defaults(func=run_list)

    rm = command("rm", "remove a model from the cache")
    rm.add_argument("name", metavar="NAME", help="a name from slipstream list (or its file "
                    "name, or the URL it came from)")
    rm.set_defaults(func=run_rm)


def run_list(a: argparse.Namespace) -> int:
    models = list_models()
    if broken := partials():
        err.print(f"{len(broken)} unfinished download(s), not models until `slipstream pull "
                  f"URL` completes them: {escape(', '.join(str(p) for p in broken))}",
                  highlight=False, soft_wrap=True)
    if not models:
        err.print(f"no models in {escape(str(cache_dir()))} (slipstream pull MODEL adds one)",
                  highlight=False, soft_wrap=True)
        return 0
    t = Table(title=f"models in {escape(str(cache_dir()))}")
    t.add_column("name", overflow="fold")
    t.add_column("size", justify="right", no_wrap=True)
    t.add_column("source", overflow="fold")
    t.add_column("path", overflow="fold")
    for m in models:
        t.add_row(escape(m.name), f"{m.size / 2**20:,.1f} MiB", escape(m.source),
                  escape(str(m.path)))
    # piped: one row per line, unfolded, for grep and awk
    Console(width=None if sys.stdout.isatty() else 10_000).print(t)
    return 0


def run_rm(a: argparse.Namespace) -> int:
    m = find(a.name)
    if m is None:
        raise ModelNotFound(f"no cached model named {a.name!r} (slipstream list shows them)")
    remove(m)
    err.print(f"removed {escape(m.name)} ({m.size / 2**20:,.1f} MiB, {escape(str(m.path))})",
              highlight=False, soft_wrap=True)
    return 0
