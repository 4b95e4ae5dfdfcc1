"""The step contract: which positions a forward step's tokens have, which KV slots they write,
and which cache entries each token may attend to.

A position is what RoPE rotates by; a slot is where a token's key and value sit in the cache.
They coincide for plain text (prefill and decode append at slot = position), and part ways for
a tree of drafted tokens: many tokens share a position (their depth), each in a slot of its own,
and each attends to the prefix and to its own ancestors only. The engine builds plain steps
itself; a caller (speculative decoding) builds tree steps and passes them to
`Engine.forward(tokens, step=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch


@dataclass(frozen=True)
class Step:
    """One forward step over T tokens.

    `causal` says that slots equal positions and token t attends to every slot up to its own,
    which lets attention drop the mask and the fused decode kernels run. Otherwise `allowed`
    (T, span) says which cache entries each token may read. `start` is the first slot when the
    slots are the contiguous run start .. start + T - 1 and the host knows it (a slice write);
    a graph-captured decode step keeps its position on the device only, so its start is None.
    """

    positions: torch.Tensor  # (T,) long, on the device: RoPE positions
    slots: torch.Tensor  # (T,) long, on the device: the KV slots written
    span: int  # attention reads cache slots [0, span)
    end: int  # one past the highest slot written (the cache length after the step), host-known
    start: int | None = None
    causal: bool = True
    allowed: torch.Tensor | None = None  # (T, span) bool when not causal
    # the attention mask in (group, T) row folding, built once per step by `with_mask` and
    # shared by every layer; None where attention needs none
    mask: torch.Tensor | None = None
    # the ring length the mask was built for (model.ring.ring_step: keys are a sliding-window
    # layer's ring, then the step's own); 0: the mask is over linear slots [0, span)
    ring: int = 0

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def needs_mask(self) -> bool:
        """False only for one causal token reading exactly the slots up to its own."""
        return not (self.causal and self.tokens == 1 and self.start is not None
                    and self.span == self.start + 1)

    def with_mask(self, group: int) -> "Step":
        """This step with its folded attention mask built (once, for all layers)."""
        if not self.needs_mask or self.mask is not None:
            return self
        allowed = causal_allowed(self.slots, self.span) if self.causal else self.allowed
        return replace(self, mask=fold_rows(allowed, group))

    def with_window(self, window: int, group: int) -> "Step":
        """This step for a sliding-window layer: each token also reads only the slots of the
        last `window` positions, i.e. slot j only where j > position - window. Slots equal
        positions before a tree's first slot; a tree's own tokens sit at slots past its root's
        position and never further from a token than the tree is deep, so they pass for any
        window deeper than the tree. A step that needs no mask (one token over its slots)
        is returned as it is: its layer slices the window out of the cache instead."""
        if not self.needs_mask:
            return self
        allowed = causal_allowed(self.slots, self.span) if self.causal else self.allowed
        keys = torch.arange(self.span, device=self.positions.device)
        allowed = allowed & (keys[None, :] > self.positions[:, None] - window)
        return replace(self, mask=fold_rows(allowed, group))

    def to(self, device: torch.device) -> "Step":
        """The same step with its tensors on `device` (a stage on another device)."""
        if self.positions.device == device:
            return self
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device) if t is not None else None

        return replace(self, positions=self.positions.to(device), slots=self.slots.to(device),
                       allowed=move(self.allowed), mask=move(self.mask))


def fold_rows(allowed: torch.Tensor, group: int) -> torch.Tensor:
    """(T, span) -> (group * T, span): the query heads that share one KV head are folded into
    the row dimension, ordered (group, T), so K and V are never copied per query head."""
    return allowed.repeat(group, 1)


def causal_allowed(slots: torch.Tensor, span: int) -> torch.Tensor:
    """(T, span) bool: token t may read every slot up to its own."""
    keys = torch.arange(span, device=slots.device)
    return keys[None, :] <= slots[:, None]


def append_step(start: int, n: int, device: torch.device, span: int | None = None) -> Step:
    """n tokens appended at slots = positions start .. start + n - 1 (prefill, or one decode
    token). `span` may exceed start + n (slots past the last token are masked out)."""
    positions = torch.arange(start, start + n, device=device)
    return Step(positions, positions, span=start + n if span is None else span, end=start + n,
                start=start)


def device_decode_step(pos: torch.Tensor, span: int) -> Step:
    """A decode step whose position lives only in device memory (`pos`, (1,) long), for a
    captured CUDA graph that replays at any position below `span`. Its `end` is only a bound
    (the host does not know the position): the graph's owner keeps the cache length itself
    (runtime.graphs), so such a step goes to `Engine.run_step`, never `Engine.forward`."""
    return Step(pos, pos, span=span, end=span, start=None)


def tree_step(parents: Sequence[int], start: int, root_position: int,
              device: torch.device, first: int = 0) -> Step:
    """A tree of T tokens written at slots start .. start + T - 1 over a cache whose first
    `start` slots hold the prefix.

    parents[t] is the index (< t) of token t's parent in the tree, or -1 for a child of the
    prefix's last token. Token t sits at position root_position + depth(t) (depth 0 for the
    children of the prefix), so siblings share a position. It attends to the whole prefix, its
    ancestors and itself, nothing else.

    first > 0 gives the step for tokens first .. T - 1 only, for a tree grown level by level
    (a speculative draft): tokens 0 .. first - 1 already sit in the cache at slots start ..
    start + first - 1, and the new tokens read the ones among them that are their ancestors."""
    T = len(parents)
    if not 0 <= first < T:
        raise ValueError(f"first = {first}: the step needs at least one new token of the "
                         f"{T} in the tree")
    depth = [0] * T
    ancestors = torch.zeros(T, T, dtype=torch.bool)
    for t, p in enumerate(parents):
        if not -1 <= p < t:
            raise ValueError(f"parents[{t}] = {p}: a parent must come before its child "
                             f"(or be -1 for the prefix)")
        if p >= 0:
            depth[t] = depth[p] + 1
            ancestors[t] = ancestors[p]
        ancestors[t, t] = True
    n = T - first
    allowed = torch.cat((torch.ones(n, start, dtype=torch.bool), ancestors[first:]), dim=1)
    positions = torch.tensor(depth[first:], dtype=torch.long) + root_position
    slots = torch.arange(start + first, start + T)
    return Step(positions.to(device), slots.to(device), span=start + T, end=start + T,
                start=start + first, causal=False, allowed=allowed.to(device))
