"""`slipstream quantize`: re-encode a GGUF's weights in another type (e.g. a speculative
draft)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from ..errors import BadArgument, SlipstreamError
from ..hub.pull import resolve
from .render import err


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    q = command("quantize", "re-encode a GGUF's weights in another type (e.g. a speculative "
                "draft)")
    q.add_argument("src", metavar="SRC", help="the GGUF to read: anything -m takes (a path, "
                   "a cached model's name, USER/REPO/FILE.gguf, a URL)")
    q.add_argument("dst", metavar="DST", help="the GGUF to write (metadata copied whole)")
    q.add_argument("type", metavar="TYPE", help="the weights' new type: Q4_0, Q8_0, Q4_K, "
                   "Q2_K, F16, ...")
    q.add_argument("--only", action="append", default=[], metavar="TYPE", help="re-encode "
                   "only tensors of this type (repeatable; default: every matrix, the norms "
                   "stay F32)")
    q.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    # numpy, gguf and torch: the encoders'
    from gguf import GGMLQuantizationType

    from ..quant.requantize import parse_type, requantize

    qtype = parse_type(a.type)  # a bad name fails here, before the source is read
    # the resolver -m uses, so that every command that reads a model takes the same names
    a.src = str(resolve(a.src))
    only = [source_type(GGMLQuantizationType, name) for name in a.only] or None
    t0 = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task(f"{Path(a.src).name} to {qtype.name}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            path = requantize(a.src, a.dst, qtype, only=only, progress=progress)
        except OSError as e:  # the destination's folder is missing or not writable
            raise SlipstreamError(f"cannot write {a.dst!r}: {e.strerror}") from None
    size = path.stat().st_size
    err.print(f"wrote {path} ({size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s)")
    print(path)
    return 0


def source_type(types, name: str):
    """--only's type: any GGML type a source may hold, not only the encodable ones."""
    try:
        return types[name.upper()]
    except KeyError:
        raise BadArgument(f"--only {name!r} is not a GGML tensor type (Q4_1, Q6_K, F16, ...)"
                          ) from None
