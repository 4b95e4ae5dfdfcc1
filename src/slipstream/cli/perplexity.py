"""`slipstream perplexity`: perplexity of a text file, by llama.cpp's method."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import SlipstreamError
from .loading import load_model
from .options import add_model_args
from .render import err


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    pp = command("perplexity", "perplexity of a text file, llama.cpp's method")
    add_model_args(pp)
    pp.add_argument("-f", "--file", required=True, help="the UTF-8 text to score")
    pp.add_argument("--chunks", type=int, default=None, help="score at most this many chunks "
                    "(default: all)")
    pp.add_argument("--decode-path", action="store_true", help="feed each chunk one token at "
                    "a time, through the kernels generation uses (slower; measures what "
                    "--precision costs in generation, which the batched path does not use)")
    pp.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..runtime.perplexity import perplexity  # imports torch

    try:
        text = Path(a.file).read_text(encoding="utf-8")
    except OSError as e:
        raise SlipstreamError(f"cannot read {a.file!r}: {e.strerror}") from None
    if a.ctx is None:
        a.ctx = 512
    model = load_model(a)
    tokens = model.tokenize(text, add_special=True, parse_special=False)
    bos = model.tokenizer.bos_id if tokens and tokens[0] == model.tokenizer.bos_id else None

    def logits(ids):
        return model.logits(ids, one_at_a_time=a.decode_path)

    t0 = time.perf_counter()
    res = perplexity(logits, tokens, a.ctx, bos_id=bos, max_chunks=a.chunks,
                     on_chunk=lambda c, p: err.print(f"[dim]chunk {c + 1}: ppl {p:.4f}[/dim]"))
    dt = time.perf_counter() - t0
    print(f"perplexity {res.ppl:.4f} over {res.scored_tokens} tokens ({res.chunks} chunks of "
          f"{res.ctx}), {res.chunks * res.ctx / dt:.1f} tok/s")
    return 0

