"""Perplexity the way llama.cpp's `llama-perplexity` measures it, so the figures compare.

The token stream is cut into chunks of n_ctx tokens. Each chunk is evaluated in a fresh context
(its first token replaced by BOS when the model adds one), and only the second half of each chunk
is scored, so every scored token sees at least n_ctx/2 tokens of context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import BadArgument


class TextTooShort(BadArgument):
    """The text has fewer tokens than two chunks' worth of context needs."""


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token
    scored_tokens: int
    chunks: int
    ctx: int


def perplexity(logits_fn: Callable[[list[int]], torch.Tensor], tokens: Sequence[int], ctx: int,
               bos_id: int | None = None, max_chunks: int | None = None,
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    n_chunks = len(tokens) // ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise TextTooShort(f"the text has {len(tokens)} tokens, fewer than one chunk of "
                           f"--ctx {ctx}; use a longer text or a smaller --ctx")
    first = ctx // 2
    total_nll, count = 0.0, 0
    for c in range(n_chunks):
        chunk = list(tokens[c * ctx:(c + 1) * ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_fn(chunk).float()  # (ctx, vocab)
        logprobs = torch.log_softmax(logits[first:ctx - 1], dim=-1)
        targets = torch.tensor(chunk[first + 1:ctx], dtype=torch.long)
        nll = -logprobs.gather(1, targets[:, None]).squeeze(1)
        total_nll += float(nll.double().sum())
        count += int(targets.numel())
        if on_chunk is not None:
            on_chunk(c, math.exp(total_nll / count))
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, count, n_chunks, ctx)
