"""A sliding-window layer's KV ring: the cache keeps only the slots its queries can still read.

A sliding-window layer (Gemma 3: 5 of 6 layers, window 1024 in 27B; Cohere 2, gpt-oss, Gemma
4) reads the keys of the last `window` positions only, so its cache holds a ring of
R = window + RING_RESERVE slots instead of the whole context: linear slot j (the slot a
full-length cache would use, model.step) sits at physical slot j mod R. Gemma-3-27B at ctx
8192 and f16 keeps 8 KiB a slot a layer, so its 52 windowed layers drop from 3.3 GiB to
0.7 GiB. Global layers keep the whole context.

Keys are cached after RoPE, so which physical slot holds a key does not change its scores:
attention over the ring differs from attention over the full cache only in the order the
softmax and the value sum add up (tests/model/test_ring.py bounds it). Resident, streamed and
hybrid runs all use these rings and these reads, so they agree bit for bit among themselves.

How a step reads the ring:
- one causal token with its slots known on the host (CPU decode): written at pos mod R, then
  the window read as one slice, or as two where it wraps (`window_attention`);
- the fused CUDA decode kernels: the same write, and a read of linear slots lo..pos taken
  mod R (kernels.attention), in linear order;
- any masked step (a prefill chunk, a tree of drafted tokens, a graph-captured step): the ring
  as it was before the step, followed by the step's own keys, under a mask built from the
  linear slot each entry holds (`ring_step`); the step's keys are written only afterwards, so
  a prefill chunk of any length (past the window too) reads every key it needs.

Why window + RING_RESERVE: speculative decoding writes a tree past the context and then keeps
one branch (compact) or truncates (runtime.kv_cache). Those writes land on the ring slots of
the oldest positions; with RING_RESERVE slots past the window, a tree of up to RING_RESERVE
tokens (rounds after it included) overwrites only keys no query at or past the context can
read. The largest tree the sizer picks is 512 nodes (speculative.sizing.NODE_CHOICES), and a
captured tree level pads up to 128 more rows that also write (runtime.graphs.STEP_WIDTHS):
640. A rollback further than that is refused (KVCache.truncate), not read as wrong keys.
llama.cpp's SWA cache is window + n_ubatch (512) cells, for the same reason.

A windowed layer whose keys another layer reuses (Gemma 4's kv-sharing layers) keeps the full
context: the reusers read after the source wrote, which a prefill chunk longer than the
reserve would have overwritten. The slot counts live in model.ring_size (no torch there).
"""

from __future__ import annotations

import torch

from .ring_size import RING_RESERVE, RING_TREE, ring_slots  # noqa: F401 (re-exported)
from .step import Step, fold_rows

_ZERO = torch.zeros(())  # baddbmm's ignored input (beta=0)

def wraps(step: Step, window: int, k_cache: torch.Tensor) -> bool:
    """Whether a windowed layer's step must read its cache as a ring: the step reaches past
    the cache's slots. Until then a ring holds slot j at j, as a full cache does, and the
    plain path reads it (a full cache never wraps: the context check bounds every step)."""
    return bool(window) and step.span > k_cache.shape[1]


def held_slots(first: torch.Tensor | int, ring: int, device: torch.device) -> torch.Tensor:
    """(ring,) long: the linear slot each physical slot holds before a step writing from
    linear slot `first` on, the latest j < first with j = s mod ring (negative: never
    written)."""
    s = torch.arange(ring, device=device)
    last = first - 1
    return last - torch.remainder(last - s, ring)


def ring_step(step: Step, window: int, group: int, ring: int) -> Step:
    """The step with the mask of a ring read (`ring_attention`): (T, ring + T) keys, the ring
    as it was before the step, then the step's own T keys. Entry k holding linear slot j is
    allowed to token t where j >= 0 (written), j > position_t - window, and the step's own
    rule allows it (causal: j <= slot_t; a tree: its `allowed` at j). Each token's own key
    is always allowed, which changes nothing for a real token and keeps a captured graph's
    padding rows (runtime.graphs) finite. Device ops only, so a graph can capture it."""
    dev = step.positions.device
    T = step.tokens
    keys = torch.cat((held_slots(step.slots[:1], ring, dev), step.slots))  # (ring + T,)
    if step.causal:
        base = keys[None, :] <= step.slots[:, None]
    else:
        base = step.allowed.index_select(1, keys.clamp(min=0, max=step.span - 1))
    allowed = (base & (keys >= 0)[None, :]
               & (keys[None, :] > step.positions[:, None] - window))
    own = torch.eye(T, dtype=torch.bool, device=dev)
    allowed = torch.cat((allowed[:, :ring], allowed[:, ring:] | own), dim=1)
    return Step(step.positions, step.slots, span=step.span, end=step.end, start=step.start,
                causal=False, allowed=allowed, mask=fold_rows(allowed, group), ring=ring)


def ring_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a ring step reads: the ring before the step, then the step's own
    (n_kv, T, d) in the cache dtype: (n_kv, ring + T, d) each."""
    k = torch.cat((k_cache, k_new.to(k_cache.dtype)), dim=1)
    v = torch.cat((v_cache, v_new.to(v_cache.dtype)), dim=1)
    return k, v


def ring_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor, step: Step) -> None:
    """Write the step's keys and values (n_kv, T, d) at their slots mod the ring, after the
    step read the ring: of a chunk longer than the ring, only its last `ring` tokens (the
    earlier ones would be overwritten in the same write)."""
    ring = k_cache.shape[1]
    slots = step.slots
    if step.tokens > ring:
        slots, k_new, v_new = slots[-ring:], k_new[:, -ring:], v_new[:, -ring:]
    phys = torch.remainder(slots, ring)
    k_cache.index_copy_(1, phys, k_new.to(k_cache.dtype))
    v_cache.index_copy_(1, phys, v_new.to(v_cache.dtype))


def window_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, window: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of linear slots max(0, pos + 1 - window) .. pos of a ring (or of a
    full cache), (n_kv, n, d) each, in linear order: one slice, or where the window wraps
    around the ring, two slices joined (a copy of the window; `window_attention` spares it
    on the CPU)."""
    a, b = _window_bounds(k_cache.shape[1], pos, window)
    if a < b:
        return k_cache[:, a:b], v_cache[:, a:b]
    return (torch.cat((k_cache[:, a:], k_cache[:, :b]), dim=1),
            torch.cat((v_cache[:, a:], v_cache[:, :b]), dim=1))


def window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int,
                     window: int, scale: float, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """softmax(q k^T * scale) v of one token over the window of linear slot `pos` (every slot
    up to it where window is 0), on the CPU: q (n_kv, group, d) in the cache dtype; returns
    (n_kv, group, d), in `out` where given. Two bmm and a softmax, as model.llama.attention
    runs them (CPU SDPA costs ~2.5x more at these shapes); where the window wraps around the
    ring, each slice's scores are joined (n_kv x group x window floats) instead of the keys
    and values (2 x 8 MiB a layer for Gemma-3-27B's window at f32: at its shapes on the
    shared 2-core machine, under load 4-6, joining them took 1.8-2.3x the time of an
    unwrapped window, the scores 1.4-1.5x; minimum and median of 15 runs)."""
    a, b = _window_bounds(k_cache.shape[1], pos, window)
    if a < b:
        scores = torch.baddbmm(_ZERO, q, k_cache[:, a:b].transpose(1, 2), beta=0, alpha=scale)
        return torch.bmm(torch.softmax(scores, dim=-1), v_cache[:, a:b], out=out)
    scores = torch.cat((
        torch.baddbmm(_ZERO, q, k_cache[:, a:].transpose(1, 2), beta=0, alpha=scale),
        torch.baddbmm(_ZERO, q, k_cache[:, :b].transpose(1, 2), beta=0, alpha=scale)), dim=-1)
    p = torch.softmax(scores, dim=-1)
    n = k_cache.shape[1] - a
    o = torch.bmm(p[..., :n], v_cache[:, a:], out=out)
    return o.add_(torch.bmm(p[..., n:], v_cache[:, :b]))


def _window_bounds(ring: int, pos: int, window: int) -> tuple[int, int]:
    """(a, b): the window of linear slot pos is ring slots a .. b - 1, or where a >= b,
    a .. ring - 1 and then 0 .. b - 1."""
    lo = max(0, pos + 1 - window) if window else 0
    return lo % ring, pos % ring + 1
