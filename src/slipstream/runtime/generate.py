"""The generation loop: prefill the prompt, then decode token by token until a stop condition.

Text is streamed through the tokenizer's incremental decoder, so a multi-byte character split
across tokens is never emitted half-way, and text that might be the start of a stop string is
held back until it is known not to be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..errors import BadArgument, ContextOverflow, NonFiniteLogits
from .engine import Engine
from .sampler import Sampler


@dataclass
class GenerationEvent:
    """One generated token. `text` is the new printable text (may be empty while held back).

    The last event of a generation has `finish_reason` "stop" (EOS/EOT token or stop string)
    or "length" (max_tokens or the context filled up).
    """

    id: int
    text: str
    index: int
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    """One generation's figures, as mlx-lm's GenerationResponse carries them: tokens, prefill
    and decode seconds and rates, the finish reason ("stop", "length", or None where the
    caller stopped it), the peak of CUDA memory allocated (bytes, None on CPU), and in
    `extra` the token source's own figures (speculative decoding's "spec_*")."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    peak_memory: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first generated token comes from the prefill logits, the rest from decode steps
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    @property
    def speculation(self) -> dict | None:
        """Speculative decoding's figures (tokens per target pass, target passes,
        accepted-depth histogram, mean tree nodes, draft and verify seconds), or None where
        the generation decoded plainly."""
        spec = {k[len("spec_"):]: v for k, v in self.extra.items() if k.startswith("spec_")}
        return spec or None


class Generation:
    """What Model.generate returns: the generation's GenerationEvents, as an iterator, and
    its figures (`stats`), complete once the iterator has ended or been closed (a consumer
    that stops early closes it, which ends prefill or decode where it stands)."""

    def __init__(self, events: Iterator[GenerationEvent], stats: GenerationStats):
        self._events = events
        self._stats = stats

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> GenerationEvent:
        return next(self._events)

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()

    @property
    def stats(self) -> GenerationStats:
        return self._stats

    @property
    def speculation(self) -> dict | None:
        """stats.speculation: the speculative figures, or None for plain decoding."""
        return self._stats.speculation


class _StopMatcher:
    """Holds back text that could still turn into a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out = self.pending[:i]
                self.pending = ""
                return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# A token source turns a prompt into generated tokens (0-d tensors, possibly still being
# computed on the device): plain decoding is one (`autoregressive`); speculative decoding is
# another, yielding several tokens per target pass. `generate` owns everything else: text,
# stop strings, events, stats.
TokenSource = Callable[[Engine, list[int], Sampler, int, GenerationStats],
                       Iterator[torch.Tensor]]


def autoregressive(engine: Engine, prompt: list[int], sampler: Sampler, budget: int,
                   stats: GenerationStats) -> Iterator[torch.Tensor]:
    """Prefill the prompt in a fresh context, then one decode step per token (at most
    `budget` tokens). Sets stats.prefill_s."""
    history = torch.tensor(prompt, dtype=torch.long, device=engine.device)
    engine.reset()
    t0 = time.perf_counter()
    try:
        logits = engine.forward(prompt)[-1]
        token = sampler(logits, history)  # 0-d, on the device
    finally:  # a prefill stopped part way (Engine.between_layers) reports its time too
        stats.prefill_s = time.perf_counter() - t0
    history = torch.cat((history, token.view(1)))
    more = budget - 1
    # queued before the first token is read back, as decode_steps does for the others
    logits = engine.decode(token.view(1)) if (more and engine.device.type == "cuda") else None
    yield token
    if more:
        yield from decode_steps(engine, token, history, sampler, more, logits)


def decode_steps(engine: Engine, token: torch.Tensor, history: torch.Tensor, sampler: Sampler,
                 count: int, logits: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Plain decoding from a drawn token: `count` more tokens, one decode step each. `token`
    is emitted but not yet in the cache, `history` ends with it; `logits`, if given, are its
    decode step's, already queued. Speculative decoding hands over to this once its draft is
    given up, so that the rest of the generation runs exactly as plain decoding does."""
    # Looking one step ahead only pays where the device runs asynchronously to the host.
    ahead = engine.device.type == "cuda"
    if logits is None:
        logits = engine.decode(token.view(1))
    for index in range(count):
        token = sampler(logits[-1], history)
        history = torch.cat((history, token.view(1)))
        last = index == count - 1
        # On CUDA, queue the next step before this token is read back: the device computes
        # step t+1 while the host turns token t into text. A step that turns out not to be
        # needed (a stop) is wasted work, never a wrong result: the next generation resets.
        logits = engine.decode(token.view(1)) if (ahead and not last) else None
        yield token
        if not last and logits is None:
            logits = engine.decode(token.view(1))


def generate(engine: Engine, tokenizer, prompt_ids: Sequence[int], sampler: Sampler,
             max_tokens: int, stop: Sequence[str] = (), stop_ids: set[int] | None = None,
             stats: GenerationStats | None = None,
             source: TokenSource = autoregressive) -> Iterator[GenerationEvent]:
    """Yield GenerationEvents for a fresh context holding prompt_ids, with tokens drawn from
    `source` (plain decoding by default) through `sampler`."""
    prompt = list(prompt_ids)
    if not prompt:
        raise BadArgument("the prompt is empty; give at least one token")
    if len(prompt) >= engine.ctx:
        raise ContextOverflow(f"the prompt has {len(prompt)} tokens but the context holds "
                              f"{engine.ctx}; shorten the prompt or raise --ctx")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    split_before = _split_counts(engine)
    tier_before = _tier_counts(engine)
    stop_ids = set(stop_ids) if stop_ids is not None else set(tokenizer.eot_ids)
    decoder = tokenizer.stream_decoder()
    matcher = _StopMatcher(stop)
    budget = min(max_tokens, engine.ctx - len(prompt))
    if budget <= 0:
        return

    tokens = source(engine, prompt, sampler, budget, stats)
    t_decode = None
    try:
        for index, token in enumerate(tokens):
            if t_decode is None:
                t_decode = time.perf_counter()  # decode time counts from the first token
            # the token and the sampler's non-finite flag in one read from the device
            tid, bad = torch.stack((token.view(()), sampler.nonfinite.long())).tolist()
            if bad:
                raise NonFiniteLogits(
                    f"the model produced NaN or Inf logits at generated token {index} (after "
                    f"a {len(prompt)}-token prompt); its weights may be corrupt or out of "
                    f"range: check the file's source, download it again, or try "
                    f"--precision exact")
            stats.generated_tokens = index + 1
            if tid in stop_ids:
                tail = matcher.flush() + decoder.flush()
                stats.finish_reason = "stop"
                yield GenerationEvent(tid, tail, index, "stop")
                return
            text, hit = matcher.push(decoder.push(tid))
            if hit:
                stats.finish_reason = "stop"
                yield GenerationEvent(tid, text, index, "stop")
                return
            if index == budget - 1:
                text += matcher.push(decoder.flush())[0] + matcher.flush()
                stats.finish_reason = "length"
                yield GenerationEvent(tid, text, index, "length")
                return
            yield GenerationEvent(tid, text, index)
    finally:
        tokens.close()
        if t_decode is not None:
            stats.decode_s = time.perf_counter() - t_decode
        if engine.device.type == "cuda":  # the allocator's own count: no device sync
            stats.peak_memory = torch.cuda.max_memory_allocated(engine.device)
        split = [b - a for a, b in zip(split_before, _split_counts(engine))]
        pairs = split[0] + split[1] + split[6]
        if pairs:  # a mixture of experts split with the CPU
            stats.extra.update(zip(SPLIT_KEYS, split))
            stats.extra["experts_vram_rate"] = split[0] / pairs
        tier = [b - a for a, b in zip(tier_before, _tier_counts(engine))]
        if tier[1]:  # a mixture of experts with cold experts read from the file
            stats.extra.update(zip(TIER_KEYS, tier))
            if tier[2]:  # read ahead (weights.expert_ahead)
                stats.extra["experts_ahead_rate"] = tier[3] / tier[1]


# GenerationStats.extra's keys of a mixture of experts split between VRAM and the CPU
# (weights.split_experts): routed (token, expert) pairs computed from VRAM and by the CPU, the
# host syncs for the routing, the swaps into VRAM, and a prefill's experts streamed to the GPU
# (weights.expert_stream) with their bytes and routed pairs; "experts_vram_rate" is the share
# of pairs served from VRAM slots
SPLIT_KEYS = ("experts_vram_pairs", "experts_cpu_pairs", "experts_syncs", "experts_swaps",
              "experts_streamed", "experts_stream_bytes", "experts_stream_pairs")


def _split_counts(engine) -> list[int]:
    """The layer store's counters behind SPLIT_KEYS (memory.protocol.StoreStats)."""
    s = engine.layers.stats
    return [s.expert_vram_pairs, s.expert_cpu_pairs, s.expert_syncs, s.expert_swaps,
            s.expert_streamed, s.expert_stream_bytes, s.expert_stream_pairs]


# GenerationStats.extra's keys of a mixture of experts with experts on disk
# (weights.expert_tiers): expert calls served from RAM and read from the file (misses), the
# experts read ahead and the misses so served; "experts_ahead_rate" is the share of misses
# read ahead (weights.expert_ahead)
TIER_KEYS = ("experts_ram_calls", "experts_misses", "experts_ahead_reads", "experts_ahead_hits")


def _tier_counts(engine) -> list[int]:
    """The layer store's counters behind TIER_KEYS (memory.protocol.StoreStats)."""
    s = engine.layers.stats
    return [s.expert_hits, s.expert_misses, s.expert_ahead_reads, s.expert_ahead_hits]
