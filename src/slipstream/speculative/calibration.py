"""The temperature a draft's tree is ranked at, fitted to what the target's walks draw.

A node's worth is the chance that the walk reaches it: the product of the target's chances of
drawing each token on its path. The draft's softmax at some temperature tau estimates those
chances, and which tau estimates them best depends on the draft: on the default model's Q8_0,
greedy, 256 nodes 16 deep, its low-bit Q4_0 copy gave 10.92 tokens a pass ranked at 0.3 and
8.72 at 1, its low-bit Q2_K copy 5.08 at 0.3 and 5.71 at 1 (CPU).

Each tau of a grid is scored, from every round, by the drafted tokens the round's walk would
have accepted had the verified tree kept only the best half of its nodes ranked at tau
(reranked_acceptance): it scores the ranking itself, as the tree uses it. On the CPU (the
default model's Q8_0, 256 nodes 16 deep, greedy) the fit gave the low-bit Q4_0 copy 10.70
tokens a pass (fitted 0.25) and the low-bit Q2_K copy 5.71 (1.0): within 2% of the best fixed
tau for each, where a fixed 0.3 cost the Q2_K copy 11% and a fixed 1 the Q4_0 copy 20%.

Until MIN_OBSERVED nodes are scored, trees rank at draft_tree.tree_tau(T). Keeping a node's
distribution at every temperature of the grid costs a pass over the vocabulary each (a
32-node level of the default model's 49,152 logits: about 33 ms for the grid on one core of
a 2-core CPU machine, against 6 ms for one temperature), so once SETTLED nodes are scored the
fit stops and trees keep its temperature, at one pass a level.

Lossless whatever tau is: the ranking decides which guesses the target verifies, never which
token it emits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .tree import DraftTree

# Temperatures the fit chooses among (a factor of about 1.4 apart); the default for the
# sampler's temperature (tree_tau) is added to them
GRID = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4)
# Nodes scored before the fit replaces the default: a round scores its accepted path's nodes
# (1 + the tokens it accepted), so a few rounds
MIN_OBSERVED = 32
# Nodes scored after which the fit stops (see the module's text)
SETTLED = 256


@dataclass(frozen=True)
class NodeDraws:
    """What ranking a node's children at any tau of the fit's grid needs of the draft's logits
    there: its top-k children's tokens and raw logits, and the logsumexp of logits / tau for
    each tau of the grid."""

    tokens: tuple[int, ...]
    logits: tuple[float, ...]
    lse: tuple[float, ...]


def logsumexps(logits: torch.Tensor, taus: Sequence[float]) -> torch.Tensor:
    """(n, len(taus)): logsumexp(logits / tau) over the vocabulary, per row and tau; one row
    of logits (n, vocab) in memory at a time beside the input."""
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - top
    cols = [torch.exp(shifted * (1.0 / tau)).sum(dim=-1).log() + top[:, 0] / tau
            for tau in taus]
    return torch.stack(cols, dim=-1)


@dataclass
class TauFit:
    """The score of each tau of `grid` (the module's text), summed over the rounds observed;
    `tau` is the ranking temperature for the next trees."""

    default: float
    grid: tuple[float, ...] = ()
    min_observed: float = MIN_OBSERVED
    settled_at: float = SETTLED
    observed: int = 0  # nodes the walks passed through with draws at every tau of the grid
    # the tokens each tau's ranking would have accepted from the verified trees, kept to half
    # their nodes (reranked_acceptance)
    walked: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.grid = tuple(sorted(set(self.grid or GRID) | {self.default}))
        if not self.walked:
            self.walked = [0.0] * len(self.grid)

    @property
    def tau(self) -> float:
        if self.observed < self.min_observed:
            return self.default
        best = max(range(len(self.grid)), key=lambda g: (self.walked[g], -abs(
            math.log(self.grid[g] / self.default))))
        return self.grid[best]

    @property
    def settled(self) -> bool:
        return self.observed >= self.settled_at

    @property
    def grid_to_keep(self) -> tuple[float, ...]:
        """The temperatures a grown tree keeps its nodes' distributions at: the grid while
        fitting, none once settled."""
        return () if self.settled else self.grid

    def observe(self, node: NodeDraws) -> None:
        """The walk passed through a node the draft ran: it counts towards MIN_OBSERVED and
        SETTLED where its distribution was kept at every temperature of the grid."""
        if not self.settled and len(node.lse) == len(self.grid):
            self.observed += 1

    def observe_walk(self, draws: dict[int, NodeDraws], path: Sequence[int]) -> None:
        """A walk that accepted `path` (tree nodes, root first): every node of it the draft
        ran is counted."""
        for node in path:
            seen = draws.get(node)
            if seen is not None:
                self.observe(seen)

    def observe_tree(self, tree: DraftTree, verify: Sequence[int], path: Sequence[int]
                     ) -> None:
        """The round's verified tree and accepted path, for the walk's score."""
        if self.settled:
            return
        got = reranked_acceptance(tree, verify, path, self.grid)
        if got is not None:
            self.walked = [w + a for w, a in zip(self.walked, got)]


def reranked_acceptance(tree: DraftTree, verify: Sequence[int], path: Sequence[int],
                        grid: Sequence[float]) -> list[int] | None:
    """For each tau of the grid, the drafted tokens the walk would have accepted had the
    tree kept only the best half of its verified nodes by their cumulative log-probability
    at tau: the accepted path's longest prefix inside that half. Within the verified tree
    only (nodes it never held have no known outcome), so biased towards the tau it was grown
    at, less so the smaller the half. None where a verified node's parent kept no draws at
    every tau."""
    n_grid = len(grid)
    inside = set(verify)
    cum = {0: [0.0] * n_grid}
    for node in verify[1:]:
        parent = tree.parents[node]
        seen = tree.draws.get(parent)
        if seen is None or len(seen.lse) != n_grid or parent not in cum:
            return None
        rank = seen.tokens.index(tree.tokens[node])
        cum[node] = [c + seen.logits[rank] / tau - seen.lse[g]
                     for g, (c, tau) in enumerate(zip(cum[parent], grid))]
    keep = max(2, len(verify) // 2)
    out = []
    for g in range(n_grid):
        best = set(sorted(inside, key=lambda v: (-cum[v][g], v))[:keep])
        accepted = 0
        for node in path[1:]:
            if node not in best:
                break
            accepted += 1
        out.append(accepted)
    return out
