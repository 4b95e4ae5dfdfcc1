"""How big a speculative tree to grow each round: Sequoia's trade-off, measured as it runs.

A round costs one target pass over the tree's N nodes, plus the draft's forwards (one per level
grown), and yields 1 + (drafted tokens accepted) tokens. The sizer keeps three figures up to
date from the rounds themselves:

  * the target pass's cost against N: a line a + b*N fitted by least squares over the passes
    seen (a streamed pass costs nearly the same for 1 node as for 512; a resident one grows);
  * the draft's cost per level (a mean over the levels run);
  * acceptance by depth: r_d, the chance that the walk descends to depth d given that it
    reached depth d - 1 and the tree went that deep, with a weak prior.

Each round it picks the depth D (0: a plain step, the draft sits out) that maximizes expected
tokens per second, E(D) / (pass(N) + D * level), with E(D) = 1 + sum_{d<=D} prod_{j<=d} r_j, and
the largest N whose predicted pass costs at most NODES_SLACK more than a one-node pass. An
explicit node budget (`--spec-nodes`) fixes N, an explicit depth (`--spec-depth`) fixes D.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NODE_CHOICES = (16, 32, 64, 128, 256, 512)
NODES_SLACK = 0.10  # a wider tree may cost this much more per pass than a one-node one
PRIOR_RATE = 0.6  # acceptance per depth before any round (weight PRIOR_WEIGHT rounds)
PRIOR_WEIGHT = 2.0
START_NODES = 64  # until two pass widths have been timed
# While plain steps win (a draft that is rarely right), one round in this many still
# speculates, so that acceptance keeps being measured and can win again
EXPLORE_EVERY = 16
# Tree rounds seen before the sizer may conclude, from acceptance alone (no prior), that no
# tree beats a plain step: then the draft is given up (its memory can go to the target)
GIVE_UP_TREES = 8


@dataclass
class TreeSizer:
    max_nodes: int = NODE_CHOICES[-1]
    max_depth: int = 8
    fixed_nodes: int | None = None  # --spec-nodes
    fixed_depth: int | None = None  # --spec-depth: every round speculates this deep
    # (nodes, seconds) of target passes; sums for the least-squares line
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _level_s: float = 0.0
    _levels: int = 0
    _plain_streak: int = 0
    reached: list[float] = field(default_factory=list)  # [d]: rounds whose tree reached depth d
    passed: list[float] = field(default_factory=list)  # [d]: ... and whose walk descended to d

    # --- what the rounds report ---------------------------------------------------------------

    def observe_pass(self, nodes: int, seconds: float) -> None:
        x, y = float(nodes), float(seconds)
        self._n += 1
        self._sx += x
        self._sy += y
        self._sxx += x * x
        self._sxy += x * y

    def observe_levels(self, levels: int, seconds: float) -> None:
        self._levels += levels
        self._level_s += seconds

    def observe_walk(self, tree_depth: int, accepted: int) -> None:
        """A round whose tree went `tree_depth` deep accepted `accepted` drafted tokens."""
        while len(self.reached) <= tree_depth:
            self.reached.append(0.0)
            self.passed.append(0.0)
        for d in range(1, tree_depth + 1):
            if d > accepted + 1:
                break
            self.reached[d] += 1  # the walk got to try depth d
            if d <= accepted:
                self.passed[d] += 1

    # --- the model ----------------------------------------------------------------------------

    def rate(self, d: int) -> float:
        """r_d with the prior; depths never tried take the deepest tried one's rate."""
        last = min(d, len(self.reached) - 1)
        while last > 1 and self.reached[last] == 0:
            last -= 1
        if last < 1:
            return PRIOR_RATE
        return ((self.passed[last] + PRIOR_RATE * PRIOR_WEIGHT)
                / (self.reached[last] + PRIOR_WEIGHT))

    def expected_tokens(self, depth: int) -> float:
        total, p = 1.0, 1.0
        for d in range(1, depth + 1):
            p *= self.rate(d)
            total += p
        return total

    def pass_s(self, nodes: int) -> float | None:
        """The fitted target pass cost at `nodes` (None before any pass)."""
        if self._n == 0:
            return None
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mean_x * mean_x
        slope = (self._sxy / self._n - mean_x * mean_y) / var if var > 1e-9 else 0.0
        slope = max(slope, 0.0)
        return max(mean_y + slope * (nodes - mean_x), 1e-9)

    @property
    def level_s(self) -> float | None:
        return self._level_s / self._levels if self._levels else None

    # --- the choice ---------------------------------------------------------------------------

    def nodes(self) -> int:
        if self.fixed_nodes is not None:
            return self.fixed_nodes
        widths_seen = self._n >= 2 and self._sxx / self._n - (self._sx / self._n) ** 2 > 1e-9
        if not widths_seen:
            # try the widest choice once early: a second width is what the line needs
            return min(START_NODES if self._n == 0 else self.max_nodes, self.max_nodes)
        one = self.pass_s(1)
        fits = [n for n in NODE_CHOICES if n <= self.max_nodes
                and self.pass_s(n) <= one * (1 + NODES_SLACK)]
        return max(fits) if fits else min(NODE_CHOICES[0], self.max_nodes)

    def choose(self) -> tuple[int, int]:
        """(nodes, depth) for the next round; depth 0 means a plain step."""
        nodes = self.nodes()
        if self.fixed_depth is not None:
            return nodes, self.fixed_depth
        pass_n, pass_1, level = self.pass_s(nodes), self.pass_s(1), self.level_s
        if pass_n is None or level is None:
            return nodes, self.max_depth  # nothing measured yet: speculate, and measure
        best, best_rate = 0, 1.0 / pass_1
        for depth in range(1, self.max_depth + 1):
            rate = self.expected_tokens(depth) / (pass_n + depth * level)
            if rate > best_rate:
                best, best_rate = depth, rate
        if best == 0:
            self._plain_streak += 1
            if self._plain_streak >= EXPLORE_EVERY:
                self._plain_streak = 0
                return nodes, self.max_depth
        else:
            self._plain_streak = 0
        return nodes, best

    @property
    def gives_up(self) -> bool:
        """Whether, after GIVE_UP_TREES tree rounds, the acceptance observed (without the
        prior) makes every depth slower than a plain step; never with a fixed tree size."""
        trees = self.reached[1] if len(self.reached) > 1 else 0
        level = self.level_s
        if (self.fixed_nodes is not None or self.fixed_depth is not None
                or trees < GIVE_UP_TREES or level is None):
            return False
        nodes = self.nodes()
        pass_n, pass_1 = self.pass_s(nodes), self.pass_s(1)
        total, p, best = 1.0, 1.0, 0.0
        for d in range(1, self.max_depth + 1):
            seen = self.reached[d] if d < len(self.reached) else 0.0
            p *= self.passed[d] / seen if seen else 0.0
            total += p
            best = max(best, total / (pass_n + d * level))
        return best < 1.0 / pass_1

    def predicted_tok_s(self, nodes: int, depth: int) -> float | None:
        pass_n, level = self.pass_s(nodes), self.level_s
        if pass_n is None:
            return None
        return self.expected_tokens(depth) / (pass_n + depth * (level or 0.0))
