"""What lets a model with linear-attention layers (Qwen3.5) roll its context back: the
token ids the context holds, and snapshots of the layers' states at a few lengths.

A KV cache rolls back by its length alone; a recurrent state has folded every token in and
cannot. `Engine.truncate(n)` therefore restores the latest snapshot at or before n and runs
the tokens from there to n again (a short re-prefill), which leaves the states as a prefill
of the first n tokens would have. Snapshots are taken after each pass of more than one token
(a prompt's prefill), so a chat turn or a retry that keeps the prompt re-runs only what was
generated after it; the latest KEEP are held (Qwen3.5-35B-A3B: 63 MiB each, 30 layers of a
32 x 128 x 128 state and a 8192 x 3 conv state, float32)."""

from __future__ import annotations

from typing import Any

import torch

KEEP = 2


class RecurrentHistory:
    """The context's token ids and the states' snapshots, by length, of one engine."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.snapshots: dict[int, list[list[torch.Tensor]]] = {}  # length -> per stage

    def clear(self) -> None:
        self.tokens.clear()
        self.snapshots.clear()

    def append(self, ids: torch.Tensor) -> None:
        self.tokens.extend(int(t) for t in ids.tolist())

    def snapshot(self, length: int, states: list[list[torch.Tensor]]) -> None:
        """Hold `states` (each stage's KVCache.states()) as the context's at `length`,
        dropping the oldest beyond KEEP."""
        self.snapshots[length] = states
        for old in sorted(self.snapshots)[:-KEEP]:
            del self.snapshots[old]

    def restart(self, n: int) -> tuple[int, list[list[torch.Tensor]] | None]:
        """(m, states): the latest snapshot at or before n (m = 0, None: the empty context),
        with the tokens and snapshots past m dropped; the caller runs tokens[m:n] again."""
        m = max((k for k in self.snapshots if k <= n), default=0)
        states = self.snapshots.get(m)
        for k in [k for k in self.snapshots if k > m]:
            del self.snapshots[k]
        return m, states


def speculation_refused(cfg: Any) -> str:
    """Why speculative decoding is refused for a model with linear-attention layers."""
    return (f"speculative decoding is not available for {cfg.architecture}: its "
            f"linear-attention layers keep a recurrent state, which a draft's tree cannot be "
            f"verified through (a tree's tokens are not one sequence) nor rolled back per "
            f"rejected token")
