"""Which of a layer's experts its VRAM slots hold, and when to change that (weights.
split_experts): the slot map and the online placement policy, plain Python, no device.

Every routed (token, expert) pair of the layer is counted. Every `every` decode tokens the
layer looks for swaps: the most used expert outside VRAM against the least used one in a
slot, swapped while the first has been used more than `margin` times the second (and at
least once more), at most `most` swaps a round (each swap copies one expert's planes over
PCIe: gpt-oss-120b's 4.2 MB, 0.3 ms at 13 GB/s). The counts are halved every `decay` pairs,
so that they follow a change of topic within a few thousand tokens; halving keeps their
order, so it swaps nothing by itself. The first placement is experts 0..slots-1: nothing is
known of the routing at the load.

The policy changes where an expert is computed, never what: a swap's copy lands before any
kernel reads the slot (weights.split_experts orders it on the streams)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadArgument

# Tokens between two placement rounds: 32 tokens of Qwen3-30B-A3B route 256 pairs per layer
# (8 a token) over its 128 experts, enough for the hottest ones to stand out
SWAP_EVERY = 32
# At most this many swaps per layer and round: 4 experts of gpt-oss-120b are 17 MB a layer,
# 36 layers 0.6 GB over PCIe (~45 ms at 13 GB/s) once every 32 tokens at the worst
MOST_SWAPS = 4
# An expert outside VRAM replaces one in it once used this much more: equally used experts
# do not trade places back and forth
SWAP_MARGIN = 1.25
# Routed pairs of a layer between two halvings of its counts (weights.expert_tiers' own)
DECAY_PAIRS = 8192


@dataclass(frozen=True)
class Swap:
    """Slot `slot` gives up expert `old` (computed by the CPU from now on) for `new`."""

    slot: int
    new: int
    old: int


class SlotMap:
    """A layer's expert -> VRAM slot map and the use counts that move experts between the
    slots and the CPU."""

    def __init__(self, n_experts: int, slots: int, every: int = SWAP_EVERY,
                 most: int = MOST_SWAPS, margin: float = SWAP_MARGIN,
                 decay: int = DECAY_PAIRS):
        if not 0 <= slots <= n_experts:
            raise BadArgument(f"slots={slots} is invalid: between 0 and the layer's "
                              f"{n_experts} experts")
        if every < 1 or most < 0 or margin < 1.0 or decay < 1:
            raise BadArgument(f"every={every}, most={most}, margin={margin}, decay={decay}: "
                              f"need every >= 1, most >= 0, margin >= 1 and decay >= 1")
        self.n_experts = n_experts
        self.expert_in = list(range(slots))  # slot -> expert
        self.slot_of = [s if s < slots else -1 for s in range(n_experts)]  # expert -> slot
        self.uses = [0] * n_experts
        self.every, self.most, self.margin, self.decay = every, most, margin, decay
        self._pairs = 0
        self._tokens = 0

    @property
    def slots(self) -> int:
        return len(self.expert_in)

    def in_vram(self, e: int) -> bool:
        return self.slot_of[e] >= 0

    def record(self, ids: list[int], tokens: int = 1) -> None:
        """Count one pass's routed experts (every (token, expert) pair's id) over `tokens`."""
        for e in ids:
            self.uses[e] += 1
        self._pairs += len(ids)
        self._tokens += tokens
        if self._pairs >= self.decay:
            self.uses = [u // 2 for u in self.uses]
            self._pairs = 0

    def due(self) -> bool:
        """Whether a placement round is due (every `every` tokens recorded)."""
        return self._tokens >= self.every and self.slots < self.n_experts and self.most > 0

    def plan_swaps(self) -> list[Swap]:
        """The round's swaps, hottest outside first, each against the coldest slot left; the
        map is not changed (apply does that, once the copies are queued)."""
        self._tokens = 0
        outside = sorted((e for e in range(self.n_experts) if self.slot_of[e] < 0),
                         key=lambda e: (-self.uses[e], e))
        inside = sorted(range(self.slots), key=lambda s: (self.uses[self.expert_in[s]], s))
        swaps = []
        for e, s in zip(outside[:self.most], inside):
            old = self.expert_in[s]
            hot, cold = self.uses[e], self.uses[old]
            if hot <= cold or hot < self.margin * cold:
                break
            swaps.append(Swap(s, e, old))
        return swaps

    def apply(self, swap: Swap) -> None:
        if self.expert_in[swap.slot] != swap.old or self.slot_of[swap.new] >= 0:
            raise BadArgument(f"swap {swap} does not match the map: slot {swap.slot} holds "
                              f"expert {self.expert_in[swap.slot]}, expert {swap.new} is in "
                              f"slot {self.slot_of[swap.new]}")
        self.expert_in[swap.slot] = swap.new
        self.slot_of[swap.new] = swap.slot
        self.slot_of[swap.old] = -1
