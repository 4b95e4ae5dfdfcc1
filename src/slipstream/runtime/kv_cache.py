"""A preallocated KV cache: allocated once for the whole context, written in place.

The cache owns its length (how many leading slots hold the context). Plain steps append;
speculative decoding writes a tree of drafted tokens past the length, then keeps the accepted
branch (`compact`) and drops the rest (`truncate`). A sliding-window layer's slots form a ring
of its window plus a reserve (model.ring), which bounds how far the cache may roll back.
"""

from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch

from ..errors import ContextOverflow, RecurrentState
from ..model import ring_size
from ..model.ring_size import ring_slots
from ..modelfile.config import ModelConfig


# below this a CPU cache is zeroed as usual (a map per cache costs more than the memset)
_MAPPED_MIN_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros. On the CPU, a large one is a private anonymous memory map, which the
    OS hands out zero-filled page by page at the first touch: the same zeros as torch.zeros,
    without writing (and faulting in) the whole context up front. The default model's cache
    at ctx 4096 is 2 x 94 MB, whose torch.zeros took 0.1 s of a `run` that writes a few
    pages of it; a slot attention reads before any token wrote it reads 0, as before."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, device=device, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the map alive


class KVCache:
    def __init__(self, cfg: ModelConfig, max_ctx: int, device: torch.device, dtype: torch.dtype,
                 n_layers: int | None = None, first: int = 0):
        """n_layers: the layers whose keys and values this cache holds (a stage's, default all),
        from layer `first` on; `layer(j)` takes the index within them. A sliding-window layer
        holds a ring of its window plus a reserve instead of the whole context
        (model.ring.ring_slots), so layers may differ in slot count."""
        self.max_ctx = max_ctx
        self._length = 0  # slots 0 .. length - 1 hold the context
        # one past the furthest slot written since the last reset: what a ring's rollback
        # is checked against (slots past the length still hold a dropped tree's entries)
        self._high = 0
        self.dtype = dtype
        # the linear-attention layers' states (the non-uniform layout below), which cannot
        # be rolled back: `states` and `restore` carry them to and from a snapshot
        self._states: list[torch.Tensor] = []
        n = cfg.n_layers if n_layers is None else n_layers
        slots = [ring_slots(cfg, i, max_ctx) for i in range(first, first + n)]
        self.rings = any(s < max_ctx for s in slots)  # whether any layer wraps around
        if cfg.uniform:
            # (n_layers, n_kv_heads, slots, head_dim) for keys and for values, one pair per
            # slot count: the global layers' (max_ctx) and the windowed layers' rings.
            # Multi-head latent attention reads its values out of the keys' latent (model.mla):
            # one tensor, which the values' view is
            self._own = []  # what compact moves: slots along dim 2, mod each one's count
            views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for count in sorted(set(slots), reverse=True):
                idx = [j for j, s in enumerate(slots) if s == count]
                shape = (len(idx), cfg.n_kv_heads, count, cfg.head_dim)
                k = zeroed(shape, device, dtype)
                v = k if cfg.mla else zeroed(shape, device, dtype)
                self._own += [k] if cfg.mla else [k, v]
                views.update({j: (k[r], v[r]) for r, j in enumerate(idx)})
            # the pair of the most slots: the full-context layers' where there are any
            self.k = self._own[0]
            self.v = self.k if cfg.mla else self._own[1]
            # each layer's (k, v) views made once: a decode step asks for every layer's, and
            # two index ops a layer are a measurable share of a CPU token
            self._layers = [views[j] for j in range(n)]
            return
        # Layers of different head shapes (Gemma 4): a (n_kv_heads, slots, head_dim) pair
        # per layer that computes its own; a layer that reuses another's gets that layer's
        # pair (the source writes it earlier in each pass, the reuser reads the same slots).
        # A linear-attention layer (Qwen3.5) gets its conv state (conv channels, kernel - 1)
        # and recurrent state (heads, state, state) in the pair's place, float32 whatever
        # the cache's dtype (llama.cpp keeps them float32 too): model.delta_net
        self._layers = []
        self._own = []
        for i in range(first, first + n):
            c = cfg.layer(i)
            if c.recurrent:
                conv = torch.zeros(c.ssm_conv_dim, c.ssm_conv_kernel - 1, device=device)
                rec = torch.zeros(c.ssm_heads, c.ssm_state, c.ssm_state, device=device)
                self._states += [conv, rec]
                self._layers.append((conv, rec))
                continue
            src = cfg.kv_source(i)
            if src != i:
                if not first <= src < first + n:
                    raise ValueError(f"layer {i} attends to the keys and values of layer "
                                     f"{src}, which another stage holds: a stage boundary "
                                     f"cannot fall between them")
                self._layers.append(self._layers[src - first])
                continue
            c = cfg.layer(i)
            shape = (c.n_kv_heads, slots[i - first], c.head_dim)
            k = zeroed(shape, device, dtype)
            v = k if c.mla else zeroed(shape, device, dtype)  # (as above)
            self._own += [k[None]] if c.mla else [k[None], v[None]]
            self._layers.append((k, v))

    def layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[j]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._own + self._states)

    @property
    def recurrent(self) -> bool:
        """Whether the cache holds linear-attention states (which cannot be rolled back)."""
        return bool(self._states)

    def states(self) -> list[torch.Tensor]:
        """A copy of the linear-attention layers' states as they are now (a snapshot)."""
        return [t.clone() for t in self._states]

    def restore(self, states: list[torch.Tensor], length: int) -> None:
        """Put back the states of a snapshot taken when the cache held `length` slots, and
        make that the length (the keys and values of the slots before it are unchanged)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot restore a snapshot of {length} slots into a cache of "
                             f"{self._length}")
        for t, saved in zip(self._states, states, strict=True):
            t.copy_(saved)
        self._length = length

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        if 0 < n < self._length:
            self._check_rollback(n)
        if n == 0:  # an empty context: the states start again from zero
            for t in self._states:
                t.zero_()
        self._length = n
        self._high = 0 if n == 0 else max(self._high, n)

    def _check_rollback(self, n: int) -> None:
        """A ring keeps RING_TREE slots past the window (model.ring): dropping more than
        that from the furthest slot written would leave keys of the window overwritten."""
        if self._states:
            raise RecurrentState(
                f"cannot roll the cache back from {self._length} to {n} tokens: the "
                f"linear-attention layers' recurrent states hold the whole context and cannot "
                f"be rolled back (Engine.truncate restarts them from a snapshot)")
        most = ring_size.RING_TREE
        if self.rings and self._high - n > most:
            raise ValueError(f"cannot roll a cache with sliding-window rings back from slot "
                             f"{self._high} to {n}: a ring keeps {most} slots past its window "
                             f"(model.ring_size.RING_TREE); use trees of at most that many "
                             f"tokens")

    def check_room(self, end: int) -> None:
        if end > self.max_ctx:
            raise ContextOverflow(f"{end} tokens do not fit the context of {self.max_ctx} "
                                  f"tokens; use a shorter prompt or a larger --ctx")

    def truncate(self, n: int) -> None:
        """Keep the first n slots (n <= length); later writes overwrite the rest."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {n}")
        self.length = n

    def compact(self, src_slots: Sequence[int] | torch.Tensor, dst_start: int) -> None:
        """Move the entries of `src_slots` (in that order) to dst_start, dst_start + 1, ...
        and make the length dst_start + len(src_slots): keep an accepted branch of a tree,
        drop the rest. Every layer moves in one gather and one write per tensor; a ring's
        slots are taken mod its length (model.ring)."""
        if self._states:
            raise RecurrentState("cannot compact a cache with linear-attention states: they "
                                 "fold in every token, kept or dropped")
        src = torch.as_tensor(src_slots, dtype=torch.long).to(self._own[0].device)
        n = int(src.numel())
        end = dst_start + n
        self.check_room(end)
        self._check_rollback(end)  # the dropped tree's entries past `end` stay in the ring
        if n:
            dst = torch.arange(dst_start, end, device=src.device)
            for t in self._own:
                count = t.shape[2]
                # index_select copies first, so overlapping source and destination are safe
                t.index_copy_(2, torch.remainder(dst, count),
                              t.index_select(2, torch.remainder(src, count)))
        self._length = end
        self._high = max(self._high, end)
