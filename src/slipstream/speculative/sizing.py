"""How big a speculative tree to grow each round: Sequoia's trade-off, measured as it runs.

A round costs one target pass over the tree's N nodes, plus the draft's forwards (one per level
grown), and yields 1 + (drafted tokens accepted) tokens. The sizer keeps three figures up to
date from the rounds themselves:

  * the target pass's cost against N: a line a + b*N fitted by least squares over the passes
    seen (a streamed pass costs nearly the same for 1 node as for 512; a resident one grows).
    A mixture of experts' pass reads the union of its tokens' experts, which grows with N
    and then saturates (ExpertTouch): its cost is fitted as a + b*N + c*U(N), U(N) the
    experts N tokens touch per layer, so an untried width's cost follows the bytes it reads,
    not a line through the widths tried;
  * the draft's cost per level (a mean over the levels run);
  * acceptance by depth: r_d, the chance that the walk descends to depth d given that it
    reached depth d - 1 and the tree went that deep, with a weak prior.

Each round it picks the depth D (0: a plain step, the draft sits out) that maximizes expected
tokens per second, E(D) / (pass(N) + D * level), with E(D) = 1 + sum_{d<=D} prod_{j<=d} r_j
(depths not yet tried taking the deepest tried one's rate), up to max_depth, and
the largest N whose predicted pass costs at most NODES_SLACK more than a one-node pass. An
explicit node budget (`--spec-nodes`) fixes N, an explicit depth (`--spec-depth`) fixes D.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from .calibration import TauFit

NODE_CHOICES = (16, 32, 64, 128, 256, 512)
NODES_SLACK = 0.10  # a wider tree may cost this much more per pass than a one-node one
PRIOR_RATE = 0.6  # acceptance per depth before any round (weight PRIOR_WEIGHT rounds)
PRIOR_WEIGHT = 2.0
START_NODES = 64  # until two pass widths have been timed
# Rounds whose draft levels the level cost is the median of. A round that first runs a level
# width, or a position past a graph's span, compiles kernels and captures graphs: on the H200
# the first run of default-spec spent 23.5 ms a level (its draft seconds over its forwards)
# where the graphs take 3.0-4.4 ms, and the next run, whose sizer still held that
# mean, took plain steps in 32 of 34 passes (27.1 tok/s, against 34.5 with trees forced).
LEVEL_ROUNDS = 15
# Passes the cost of each tree width (and of a plain step) is taken over, the same way: the
# cheapest while fewer than three, then the median; and no width costs more than a wider one
# (a pass never gets cheaper for more nodes). A mean over every pass lets one first-use pass
# set the line for the whole generation: on the H100 the 70B's first 16-node
# round took 1.73 s against 0.54 s for the 32-node one after it; and default-spec's sizer,
# whose first generation kept its draft, took plain steps in 17 of 27 rounds of the next
# (33.15 tok/s against 38.05 with the trees grown beside the pass) where its trees gave 4.6
# tokens each, presumably after
# such a pass (its passes were not recorded one by one; tests/speculative/test_spec_sizing.py
# reproduces the effect: 36 plain steps in 40 rounds with the mean, at most 3 now).
PASS_ROUNDS = 15
# For its first GIVE_UP_TREES tree rounds the choice weighs each depth's acceptance this many
# standard deviations above its estimate (an upper confidence bound): a draft whose first tree
# was unlucky is tried again at once rather than EXPLORE_EVERY plain steps later. Without it
# one failed first round took the estimate from the prior's 0.6 to 0.4 and plain steps won
# for the next 16 rounds, whatever the draft's real rate. Later rounds weigh the estimate
# itself (where trees cost about a plain step, any optimism would keep trying a useless draft).
CHOICE_OPTIMISM = 1.0
# While plain steps win (a draft that is rarely right), one round in this many still
# speculates, so that acceptance keeps being measured and can win again
EXPLORE_EVERY = 16
# Tree rounds seen before the sizer may conclude, from acceptance alone (no prior), that no
# tree beats a plain step: then the draft is given up (its memory can go to the target)
GIVE_UP_TREES = 8
# Sooner where trees are dear: after at least GIVE_UP_MIN_TREES tree rounds, the draft is also
# given up once the chance that its first-token acceptance reaches the break-even rate (the
# rate at which some tree would beat a plain step) is below GIVE_UP_BELIEF, on a uniform prior.
# The H200's 70B at 24 GiB with an 8B draft: a 256-node pass costs 0.44 s against 0.21 s for a
# plain step, so a tree needs about 65% acceptance per depth; 2 rounds that accept nothing
# leave a 4.3% chance of that (3 rounds 1.5%), where 8 rounds spent 8 x ~0.5 s learning it.
# Two, not three: the belief is the guard (one failed round leaves 12% at that rate, and a
# cheaper tree's lower break-even keeps a draft longer), and in a fresh sizer on the H200
# the third settling tree was a 0.38 s pass for one token in a 48-token run at 0.87x
# the plain decode right after it.
GIVE_UP_MIN_TREES = 2
GIVE_UP_BELIEF = 0.05
# Before any tree, the prompt already tells a draft that cannot pay: at each of its last
# positions (PROMPT_POSITIONS at most) both models give logits anyway, and whether the target's
# top token is among the draft's top few (a tree's first level) is a trial of the first
# drafted token's acceptance. Once PROMPT_MIN_TRIALS have been seen, a draft whose rate reaching
# PROMPT_FLOOR_RATE has become unlikely (GIVE_UP_BELIEF) is given up before its first tree: the
# H100's 70B with a random 8B draft spent its first two tree rounds, 2.3 s, learning what the
# prompt could have said (the floor at 0.90x). A real pair agrees far above the floor: the
# default model's Q4_0 and Q2_K copies accept 3.7-7.2 tokens a pass (CPU, 16-64 nodes).
PROMPT_POSITIONS = 64
PROMPT_MIN_TRIALS = 16
PROMPT_FLOOR_RATE = 0.25


@dataclass(frozen=True)
class ExpertTouch:
    """How many of a mixture-of-experts layer's experts a pass of n tokens reads: each token
    routes to `used` of `experts`, so n tokens touch experts * (1 - (1 - used/experts)^n) in
    expectation where routing is uniform (Qwen3-30B-A3B, 8 of 128: 82 experts for 16
    tokens, 126 for 64, all 128 for 512). Skewed routing touches fewer; the fit's coefficient
    absorbs a constant share of that."""

    experts: int
    used: int

    def __post_init__(self) -> None:
        if not 0 < self.used <= self.experts:
            raise ValueError(f"a router picking {self.used} of {self.experts} experts")

    def distinct(self, tokens: float) -> float:
        return self.experts * (1.0 - (1.0 - self.used / self.experts) ** max(tokens, 0.0))


@dataclass
class TreeSizer:
    max_nodes: int = NODE_CHOICES[-1]
    max_depth: int = 8  # the deepest tree the choice may make
    # the depth of the trees grown before anything is measured, and of the ones that explore or
    # settle whether a draft stays: a draft that accepts nothing costs the same as before the
    # choice could go deeper, and depths past it are tried once measured rates say they pay
    probe_depth: int = 8
    fixed_nodes: int | None = None  # --spec-nodes
    fixed_depth: int | None = None  # --spec-depth: every round speculates this deep
    # how much faster plain decode would run without the draft (its memory given to the
    # target: speculative.drafts.release_gain); giving the draft up is weighed against that,
    # not against plain steps with the draft still loaded
    plain_gain: float = 1.0
    # seconds of tree passes (two nodes or more) by width, the last PASS_ROUNDS of each, for
    # the line through the widths' costs (see PASS_ROUNDS). Plain steps are kept apart: a
    # hybrid plan splits only passes of a few tokens, so a one-node pass can cost much less
    # than the line through the trees says (the H200's 70B: 0.21 s for one token, 0.34-0.46 s
    # for 8 to 512)
    _plain_rounds: list[float] = field(default_factory=list)
    _width_rounds: dict[int, list[float]] = field(default_factory=dict)
    _n: int = 0  # tree passes observed
    _level_rounds: list[float] = field(default_factory=list)  # seconds a level, per round
    _plain_streak: int = 0
    # the trees' ranking temperature, fitted per sampling temperature to what the walks drew
    # (speculative.calibration): like the rates below, a lesson about this draft
    tau_fits: dict[float, TauFit] = field(default_factory=dict)
    reached: list[float] = field(default_factory=list)  # [d]: rounds whose tree reached depth d
    passed: list[float] = field(default_factory=list)  # [d]: ... and whose walk descended to d
    # the prompts' evidence (observe_prompt): positions where the target's top token was among
    # the draft's candidates, of those compared
    prompt_hits: int = 0
    prompt_trials: int = 0
    # the target's experts, for a mixture of experts: a pass's cost then follows the union of
    # experts its nodes read (see the module's docstring)
    experts: ExpertTouch | None = None

    # --- what the rounds report ---------------------------------------------------------------

    def observe_pass(self, nodes: int, seconds: float) -> None:
        rounds = self._plain_rounds if nodes <= 1 else self._width_rounds.setdefault(nodes, [])
        rounds.append(float(seconds))
        del rounds[:-PASS_ROUNDS]
        if nodes > 1:
            self._n += 1

    def observe_levels(self, levels: int, seconds: float) -> None:
        self._level_rounds.append(seconds / levels)
        del self._level_rounds[:-LEVEL_ROUNDS]

    def observe_prompt(self, hits: int, trials: int) -> None:
        """Of `trials` prompt positions, the target's top token was among the draft's top
        candidates at `hits` (PROMPT_POSITIONS' note)."""
        self.prompt_hits += int(hits)
        self.prompt_trials += int(trials)

    @property
    def prompt_says_no(self) -> bool:
        """The prompts seen make a first-token acceptance of PROMPT_FLOOR_RATE unlikely."""
        return (self.prompt_trials >= PROMPT_MIN_TRIALS
                and chance_at_least(PROMPT_FLOOR_RATE, self.prompt_hits, self.prompt_trials)
                < GIVE_UP_BELIEF)

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

    def rate(self, d: int, optimism: float = 0.0) -> float:
        """r_d with the prior; depths never tried take the deepest tried one's rate. optimism:
        that many standard deviations of the estimate added (at most 1.0)."""
        last = min(d, len(self.reached) - 1)
        while last > 1 and self.reached[last] == 0:
            last -= 1
        seen = self.reached[last] if last >= 1 else 0.0
        mean = ((self.passed[last] if last >= 1 else 0.0) + PRIOR_RATE * PRIOR_WEIGHT) \
            / (seen + PRIOR_WEIGHT)
        if not optimism:
            return mean
        return min(1.0, mean + optimism * math.sqrt(mean * (1 - mean) / (seen + PRIOR_WEIGHT + 1)))

    def expected_tokens(self, depth: int, optimism: float = 0.0) -> float:
        total, p = 1.0, 1.0
        for d in range(1, depth + 1):
            p *= self.rate(d, optimism)
            total += p
        return total

    def pass_s(self, nodes: int) -> float | None:
        """The target pass cost at `nodes`: a plain step's for one node, the line fitted
        through the tree widths' costs for more (either standing in for the other before it
        is seen; None before any pass). Each cost as PASS_ROUNDS says."""
        if not self._width_rounds or (nodes <= 1 and self._plain_rounds):
            return _robust(self._plain_rounds) if self._plain_rounds else None
        points = self._width_costs()
        if self.experts is not None:
            # a plain step is a point of the same curve here: one token's experts (no hybrid
            # split makes it cheaper, as it can a dense model's: experts are not split)
            plain = [(1.0, _robust(self._plain_rounds))] if self._plain_rounds else []
            return max(self._expert_fit(plain + points)(nodes), 1e-9)
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        var = sum((x - mean_x) ** 2 for x, _ in points) / len(points)
        cov = sum((x - mean_x) * (y - mean_y) for x, y in points) / len(points)
        slope = max(cov / var, 0.0) if var > 1e-9 else 0.0
        return max(mean_y + slope * (nodes - mean_x), 1e-9)

    def _expert_fit(self, points: list[tuple[float, float]]):
        """cost(N) = a + b*N + c*U(N) by least squares over the widths seen (three at least),
        else a + c*U(N) (a few-token pass of a mixture of experts is bound by the experts it
        reads), else a + b*N: the first whose coefficients all come out >= 0 (two widths whose
        cost rises faster than their experts' union, compute-bound ones, give U a negative
        intercept, and the line in N takes over)."""
        touch = self.experts
        assert touch is not None
        rows = [(1.0, x, touch.distinct(x)) for x, _ in points]
        ys = [y for _, y in points]
        for keep in ((0, 1, 2), (0, 2), (0, 1), (0,)):
            if len(keep) > len(points) or (len(points) < 3 and keep == (0, 1, 2)):
                continue
            coef = _least_squares([[r[k] for k in keep] for r in rows], ys)
            if coef is not None and all(c >= 0 for c in coef):
                full = dict(zip(keep, coef))
                return lambda n: (full.get(0, 0.0) + full.get(1, 0.0) * n
                                  + full.get(2, 0.0) * touch.distinct(n))
        mean = sum(ys) / len(ys)
        return lambda n: mean

    def _width_costs(self) -> list[tuple[float, float]]:
        """(width, cost) of each tree width seen, no width dearer than a wider one."""
        costs = sorted((w, _robust(r)) for w, r in self._width_rounds.items())
        out, cap = [], math.inf
        for w, c in reversed(costs):
            cap = min(cap, c)
            out.append((float(w), cap))
        return out[::-1]

    @property
    def level_s(self) -> float | None:
        """A draft level's cost: the median over the last LEVEL_ROUNDS rounds' mean levels
        (the cheapest while fewer than three), so that rounds whose growth compiled kernels or
        captured graphs do not set it (see LEVEL_ROUNDS)."""
        return _robust(self._level_rounds) if self._level_rounds else None

    # --- the choice ---------------------------------------------------------------------------

    def nodes(self) -> int:
        if self.fixed_nodes is not None:
            return self.fixed_nodes
        if self._settling:
            # the rounds that decide whether the draft stays: the narrowest trees, two widths
            # for the pass line. A draft that accepts nothing is given up on what its first
            # tokens do, which a wide tree shows no better, and on the H200's 70B these
            # rounds took 256-512-node passes (0.44-0.49 s against 0.32 s at 16; a fresh
            # sizer's 3 trees averaged 234 nodes)
            return min(NODE_CHOICES[int(self._n) % 2], self.max_nodes)
        widths_seen = len(self._width_rounds) >= 2
        if not widths_seen:
            # try the widest choice once early: a second width is what the line needs
            return min(START_NODES if self._n == 0 else self.max_nodes, self.max_nodes)
        # against the narrowest tree, not a plain step: a hybrid plan's plain step can cost
        # half a tree pass of any width (the H200's 70B: 0.21 s against 0.34-0.49), and then no
        # width would fit and every tree took the narrowest choice, however flat the line
        narrowest = self.pass_s(NODE_CHOICES[0])
        fits = [n for n in NODE_CHOICES if n <= self.max_nodes
                and self.pass_s(n) <= narrowest * (1 + NODES_SLACK)]
        return max(fits) if fits else min(NODE_CHOICES[0], self.max_nodes)

    def choose(self) -> tuple[int, int]:
        """(nodes, depth) for the next round; depth 0 means a plain step."""
        nodes = self.nodes()
        if self.fixed_depth is not None:
            return nodes, self.fixed_depth
        pass_n, pass_1, level = self.pass_s(nodes), self.pass_s(1), self.level_s
        probe = min(self.probe_depth, self.max_depth)
        if pass_n is None or level is None:
            return nodes, probe  # nothing measured yet: speculate, and measure
        if not self._plain_rounds:
            return nodes, 0  # one plain step, to know what a tree has to beat (it costs none)
        trees = self._trees
        optimism = CHOICE_OPTIMISM if trees < GIVE_UP_TREES else 0.0
        best, best_rate = 0, 1.0 / pass_1
        for depth in range(1, self.max_depth + 1):
            rate = self.expected_tokens(depth, optimism) / (pass_n + depth * level)
            if rate > best_rate:
                best, best_rate = depth, rate
        if best == 0:
            self._plain_streak += 1
            if self._plain_streak >= EXPLORE_EVERY or self._settling:
                self._plain_streak = 0
                return nodes, probe
        else:
            self._plain_streak = 0
        return nodes, best

    @property
    def _trees(self) -> float:
        """Tree rounds observed (rounds whose walk tried depth 1)."""
        return self.reached[1] if len(self.reached) > 1 else 0

    @property
    def _settling(self) -> bool:
        """Whether the rounds that decide if the draft is given up come now, back to back: while
        the draft holds memory the target would decode faster with (plain_gain > 1), a plain
        step costs more than it would after the release, so trees one in EXPLORE_EVERY would
        spend their plain steps in between at the slower rate (the H200's 70B beside an 8B
        draft: 0.28 s against 0.21 s a step; 48 tokens at 0.85x plain decode,
        where the three trees that settle it came 16 plain steps apart)."""
        trees = self._trees
        return (self.plain_gain > 1.0 and trees < GIVE_UP_MIN_TREES
                and self.fixed_nodes is None and self.fixed_depth is None)

    @property
    def gives_up(self) -> bool:
        """Whether the draft should be given up (never with a fixed tree size): at once where
        the prompts say it cannot pay (prompt_says_no); after GIVE_UP_TREES tree rounds, the
        acceptance observed (without the prior) makes every depth slower than plain decode
        without the draft (a plain step, `plain_gain` times faster); or, after
        GIVE_UP_MIN_TREES, a first-token acceptance high enough to beat that has become
        unlikely (GIVE_UP_BELIEF)."""
        if self.fixed_nodes is not None or self.fixed_depth is not None:
            return False
        if self.prompt_says_no:
            return True
        trees = self._trees
        level = self.level_s
        if trees < GIVE_UP_MIN_TREES or level is None:
            return False
        nodes = self.nodes()
        pass_n = self.pass_s(nodes)
        pass_1 = self.pass_s(1) / max(self.plain_gain, 1.0)  # plain decode once released
        needed = self.break_even_rate(pass_n, pass_1, level)
        if chance_at_least(needed, int(self.passed[1]), int(trees)) < GIVE_UP_BELIEF:
            return True
        if trees < GIVE_UP_TREES:
            return False
        total, p, best = 1.0, 1.0, 0.0
        for d in range(1, self.max_depth + 1):
            seen = self.reached[d] if d < len(self.reached) else 0.0
            p *= self.passed[d] / seen if seen else 0.0
            total += p
            best = max(best, total / (pass_n + d * level))
        return best < 1.0 / pass_1

    def break_even_rate(self, pass_n: float, pass_1: float, level: float) -> float:
        """The acceptance per depth, the same at every depth, at which the best tree of this
        size is as fast as a plain step (1.0 where none is even at full acceptance). Constant
        by depth is the assumption; a draft whose first token is rarely right but whose later
        ones nearly always are would be given up wrongly, and one right at first and wrong
        later is left to the rule on every depth's observed rate (gives_up)."""
        def pays(r: float) -> bool:
            total, p = 1.0, 1.0
            for d in range(1, self.max_depth + 1):
                p *= r
                total += p
                if total / (pass_n + d * level) >= 1.0 / pass_1:
                    return True
            return False

        if not pays(1.0):
            return 1.0
        lo, hi = 0.0, 1.0
        for _ in range(30):  # bisection: pays() is monotone in r
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pays(mid) else (mid, hi)
        return hi

    def predicted_tok_s(self, nodes: int, depth: int) -> float | None:
        pass_n, level = self.pass_s(nodes), self.level_s
        if pass_n is None:
            return None
        return self.expected_tokens(depth) / (pass_n + depth * (level or 0.0))


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """The coefficients minimising the squared error of rows @ coef against ys (the normal
    equations, solved by Gaussian elimination; a handful of widths and three unknowns at
    most), or None where they are singular."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in
                                                                  zip(rows, ys))]
         for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in a[pivot][:k])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [vr - f * vc for vr, vc in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


def _robust(samples: list[float]) -> float:
    """A cost from its last rounds: the cheapest while fewer than three (a first run that
    compiled kernels is not the cost), then the median."""
    return min(samples) if len(samples) < 3 else statistics.median(samples)


def chance_at_least(rate: float, successes: int, trials: int) -> float:
    """P(r >= rate) for a Bernoulli rate r with a uniform prior after `successes` of `trials`:
    the Beta(1 + s, 1 + f) tail, which for whole counts is a binomial sum
    (P(Binomial(trials + 1, rate) <= successes))."""
    if rate <= 0.0:
        return 1.0
    if rate >= 1.0:
        return 0.0
    n = trials + 1
    return sum(math.comb(n, k) * rate ** k * (1 - rate) ** (n - k)
               for k in range(successes + 1))
