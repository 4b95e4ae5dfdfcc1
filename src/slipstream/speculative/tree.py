"""The draft's tree of guesses and its growth (SpecExec): the most probable continuations of a
root by the draft's cumulative log-probability, grown with one draft forward per level over the
nodes picked for it.

The log-probabilities are the draft's at the temperature the target samples at (tree_tau): a
node's worth is the chance that the walk reaches it, the product of the target's chances of
drawing each token on its path, which the draft's distribution at that temperature estimates.
At temperature 0 the walk descends where the draft's token is the target's argmax, a chance
the draft's own softmax understates when it is unsure between close guesses: a sharper one
(TAU_GREEDY) ranks its chains higher. Measured on the default model's Q8_0 with its low-bit
Q4_0 copy, 256 nodes 16 deep (CPU): greedy 8.72 tokens a pass at the draft's temperature 1,
10.29 at 0.5, 10.92 at 0.3; at temperature 0.8, 6.99 at 1 and 6.97 at 0.8. A weak draft
loses by it: the low-bit Q2_K copy went from 5.71 to 5.08 greedy. So tree_tau is
only where the ranking starts: the speculator then ranks at the temperature fitted to the
target's draws (speculative.calibration), which gave the Q2_K copy 5.71 greedy (fitted 1.0)
and the Q4_0 copy 10.70 (fitted 0.25).

Node i of a tree sits at slot start + i of the draft's cache (start: the root's slot), written
only once the node has run (`ran`); a node's parent has always run, since children are known
only from their parent's logits, so on any path from the root only the last node may not have
run. Nodes that never run leave holes nothing reads: each node attends to the prefix and its
own ancestors alone.

Growth happens in two places (speculative.rounds): in series before a target pass, level by
level within a node budget and a depth, and ahead, while the target verifies a snapshot of the
tree. Growing ahead keeps expanding the same tree by the same order, past the snapshot; when
the target's walk then ends at a node the tree already holds (the token drawn after the
accepted path is a guess grown ahead), the subtree below it is the next round's tree, grown
while the target's layers streamed (`reroot`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable, Sequence

import numpy as np
import torch

from ..model import Step, tree_step
from ..runtime.engine import Engine
from .calibration import NodeDraws, logsumexps

# The draft's temperature for ranking a greedy target's tree (see the module's text)
TAU_GREEDY = 0.3


def tree_tau(temperature: float) -> float:
    """The temperature of the draft's log-probabilities that rank a tree's candidates, for a
    target sampling at `temperature`: the same, but no lower than TAU_GREEDY."""
    return max(float(temperature), TAU_GREEDY)


# How deep growing ahead may go below the root. Pushing children this deep costs only a heap
# entry each; the depth a verified snapshot may take is chosen per round (TreeSizer)
AHEAD_DEPTH = 64


class DraftTree:
    """Nodes in growth order: node 0 is the root (parent -1); a parent precedes its
    children."""

    def __init__(self, root: int) -> None:
        self.tokens: list[int] = [root]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.logprobs: list[float] = [0.0]  # cumulative from the root, the draft's
        self.children: list[dict[int, int]] = [{}]  # token -> node
        self.paths: list[tuple[int, ...]] = [(0,)]  # each node's ancestors and itself
        self.ran: list[bool] = [False]
        self.forwards = 0  # draft forwards that grew it
        # each node that ran: the draft's distribution there, as TauFit scores it
        self.draws: dict[int, NodeDraws] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftTree) and (self.tokens, self.parents, self.logprobs) == \
            (other.tokens, other.parents, other.logprobs)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def expanded(self) -> int:
        """Nodes that ran through the draft."""
        return sum(self.ran)

    def add(self, token: int, parent: int, logprob: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.logprobs.append(logprob)
        self.children.append({})
        self.children[parent][token] = node
        self.paths.append(self.paths[parent] + (node,))
        self.ran.append(False)
        return node

    def subtree(self, node: int) -> list[int]:
        """`node` and its descendants, in growth order."""
        inside = {node}
        for i in range(node + 1, len(self)):
            if self.parents[i] in inside:
                inside.add(i)
        return sorted(inside)

    def step(self, nodes: Sequence[int], start: int, device: torch.device) -> Step:
        """The draft step that runs `nodes` (ascending) at slots start + node: each attends to
        the prefix (slots < start) and to its ancestors. Built from the stored paths rather
        than from the parent list, so a level costs the host time of its own rows only."""
        T = len(self)
        n = len(nodes)
        allowed = np.zeros((n, start + T), dtype=np.bool_)
        allowed[:, :start] = True
        paths = [self.paths[i] for i in nodes]
        rows = np.repeat(np.arange(n), [len(p) for p in paths])
        allowed[rows, start + np.fromiter(itertools.chain.from_iterable(paths), np.int64)] = True
        contiguous = nodes[-1] - nodes[0] == n - 1
        idx = torch.tensor(nodes, dtype=torch.long)
        depths = torch.tensor([self.depths[i] for i in nodes], dtype=torch.long)
        return Step((depths + start).to(device), (idx + start).to(device), span=start + T,
                    end=start + T, start=start + nodes[0] if contiguous else None,
                    causal=False, allowed=torch.from_numpy(allowed).to(device))


class TreeGrower:
    """One tree being grown in the draft: the tree, the root's slot, and the candidates not yet
    in it (the children of nodes that ran, by cumulative log-prob), kept between calls so
    growth can go on after a snapshot went to the target."""

    def __init__(self, draft: Engine, tree: DraftTree, start: int, top_k: int,
                 tau: float = 1.0, grid: Sequence[float] = ()) -> None:
        """tau: the temperature the draft's logits are ranked at (tree_tau, or a TauFit's);
        grid: the temperatures each ran node's distribution is kept at for a TauFit (tau is
        added to them)."""
        self.draft, self.tree, self.start, self.top_k = draft, tree, start, top_k
        self.tau = tau
        self.grid = tuple(sorted(set(grid) | {tau}))
        # (-cumulative logprob, parent, rank, token): ties break on (parent, rank), so the
        # same logits always give the same tree
        self.pool: list[tuple[float, int, int, int]] = []
        self.unrun: list[tuple[float, int]] = []  # (-cumulative logprob, node): added, not run
        self.ahead_forwards = 0

    @classmethod
    def begin(cls, draft: Engine, root: int, lag: Sequence[int], top_k: int,
              tau: float = 1.0, grid: Sequence[float] = ()) -> "TreeGrower":
        """Level 0: the draft runs lag + root, appended at its length; the root's children
        become candidates."""
        grower = cls(draft, DraftTree(root), draft.length + len(lag), top_k, tau, grid)
        logits = _append(draft, [*lag, root])
        grower.tree.forwards = 1
        grower.tree.ran[0] = True
        grower._push_children(logits, [0])
        return grower

    # --- growth -------------------------------------------------------------------------------

    def grow(self, nodes: int, depth: int, level_width: int | None,
             levels: int | None = None, run_leaves: bool = False) -> None:
        """In series: `levels` levels (default: `depth`, a fresh tree's), nodes no deeper than
        `depth` below the root, within `nodes` (root included). Each level adds the best
        candidates, at most an even share of the remaining budget, so that a confident chain
        can reach `depth` rather than the budget going to the first levels' siblings; unpicked
        candidates stay for later levels. Every level but the last runs its nodes through the
        draft (at most `level_width` of them where given: on CUDA the rows the quantized GEMV
        serves); the last takes what the budget has left, as leaves. run_leaves: nodes added
        earlier and never run compete with the candidates (a tree grown ahead)."""
        tree = self.tree
        levels = depth if levels is None else levels
        for level in range(1, levels + 1):
            room = nodes - len(tree)
            if room <= 0 or not (self.pool or self.unrun):
                break
            last = level == levels
            take = room if last else math.ceil(room / (levels - level + 1))
            if level_width is not None and not last:
                take = min(take, level_width)
            picked = self._pick(take, depth, run_leaves)
            if not picked or last or len(tree) >= nodes:
                # leaves: their children would not be verified; they stay candidates to run
                self.unrun = [(-tree.logprobs[i], i) for i in range(len(tree))
                              if not tree.ran[i]]
                heapq.heapify(self.unrun)
                break
            self._run(picked)

    def ahead(self, go_on: Callable[[], bool], width: int, levels: int | None = None) -> int:
        """Grow past the snapshot while `go_on()` (checked before each level) and, if given,
        for at most `levels` levels: each level runs the `width` best candidates, nodes added
        earlier as leaves included. Stops where the draft's context has no room. Returns the
        levels run."""
        done = 0
        while (levels is None or done < levels) and go_on():
            room = self.draft.ctx - self.start - len(self.tree) - width
            if room < 0:
                break
            picked = self._pick(width, AHEAD_DEPTH, run_leaves=True)
            if not picked:
                break
            self._run(picked)
            done += 1
        self.ahead_forwards += done
        return done

    def top_up(self, nodes: int, depth: int, level_width: int | None) -> int:
        """In series, for a tree grown ahead: the levels that take its deepest run nodes down
        to `depth - 1` (a fresh tree's depth), so that a subtree grown shallow beside other
        outcomes is not verified shallow. Returns the draft forwards run."""
        ran_depth = max(d for d, r in zip(self.tree.depths, self.tree.ran) if r)
        before = self.tree.forwards
        if ran_depth < depth - 1:
            self.grow(nodes, depth, level_width, levels=depth - ran_depth, run_leaves=True)
        return self.tree.forwards - before

    def snapshot(self, nodes: int, depth: int) -> list[int]:
        """The nodes a target pass verifies: those of depth <= `depth` in growth order, at most
        `nodes` (a prefix of growth order is closed under ancestors), topped up with the best
        candidates as leaves while there is room."""
        keep = [i for i, d in enumerate(self.tree.depths) if d <= depth][:nodes]
        if len(keep) < nodes:
            first = len(self.tree)
            self._pick(nodes - len(keep), depth)
            keep += range(first, len(self.tree))
        return keep

    def reroot(self, path: Sequence[int], token: int) -> "TreeGrower | None":
        """After a walk that accepted `path` (root first) and drew `token` after it: if the
        tree holds that token below the path's end and it ran, the grower of its subtree, with
        the draft's cache compacted to hold the path and then the subtree (its root at the
        slot after the path). None where the tree does not hold it: the caller starts anew."""
        tree = self.tree
        node = tree.children[path[-1]].get(token)
        if node is None or not tree.ran[node]:
            return None
        sub = tree.subtree(node)
        self.draft.compact([self.start + i for i in (*path, *sub)], self.start)
        new_index = {old: new for new, old in enumerate(sub)}
        base_lp = tree.logprobs[node]
        out = DraftTree(token)
        out.ran[0] = True
        for old in sub[1:]:
            new = out.add(tree.tokens[old], new_index[tree.parents[old]],
                          tree.logprobs[old] - base_lp)
            out.ran[new] = tree.ran[old]
        out.draws = {new_index[old]: d for old, d in tree.draws.items() if old in new_index}
        grower = TreeGrower(self.draft, out, self.start + len(path), self.top_k, self.tau,
                            self.grid)
        grower.pool = [(neg + base_lp, new_index[p], r, t) for neg, p, r, t in self.pool
                       if p in new_index]
        heapq.heapify(grower.pool)
        grower.unrun = [(-out.logprobs[i], i) for i in range(len(out)) if not out.ran[i]]
        heapq.heapify(grower.unrun)
        return grower

    # --- internals ----------------------------------------------------------------------------

    def _pick(self, k: int, max_depth: int, run_leaves: bool = False) -> list[int]:
        """Up to k best candidates of depth <= max_depth, added to the tree; with run_leaves,
        nodes already added but never run compete too (growing ahead). Returns their nodes,
        ascending."""
        tree, out, deferred, deep = self.tree, [], [], []
        while len(out) < k:
            use_unrun = run_leaves and self.unrun and \
                (not self.pool or self.unrun[0][0] <= self.pool[0][0])
            if use_unrun:
                entry = heapq.heappop(self.unrun)
                if tree.depths[entry[1]] > max_depth:
                    deep.append(entry)  # put back below
                else:
                    out.append(entry[1])
                continue
            if not self.pool:
                break
            entry = heapq.heappop(self.pool)
            neg, parent, _, token = entry
            if tree.depths[parent] + 1 > max_depth:
                deferred.append(entry)
                continue
            node = tree.add(token, parent, -neg)
            out.append(node)
            heapq.heappush(self.unrun, (neg, node))  # until it runs (_run takes it out)
        for entry in deferred:
            heapq.heappush(self.pool, entry)
        for entry in deep:
            heapq.heappush(self.unrun, entry)
        return sorted(out)

    def _run(self, nodes: list[int]) -> None:
        """One draft forward over `nodes`; their children become candidates."""
        tree = self.tree
        ran = set(nodes)
        self.unrun = [e for e in self.unrun if e[1] not in ran]
        heapq.heapify(self.unrun)
        step = tree.step(nodes, self.start, self.draft.device)
        logits = self.draft.forward([tree.tokens[i] for i in nodes], all_logits=True,
                                    step=step)
        tree.forwards += 1
        for i in nodes:
            tree.ran[i] = True
        self._push_children(logits, nodes)

    def _push_children(self, logits: torch.Tensor, nodes: Sequence[int]) -> None:
        """The top-k children of `nodes` (one row of draft logits each) become candidates,
        ranked by log-softmax(logits / tau); each node's draws are kept for a TauFit."""
        logits = logits.float()
        k = min(self.top_k, logits.shape[-1])
        top, ids = torch.topk(logits, k, dim=-1)  # the same order at any temperature
        # .cpu() first: its binding lets go of the GIL while it waits for the device, which
        # the main thread needs to go on launching the target's pass (growing ahead)
        rows = torch.cat((top, logsumexps(logits, self.grid)), dim=-1).cpu().tolist()
        ids = ids.cpu().tolist()
        g = self.grid.index(self.tau)
        tree = self.tree
        for node, row, toks in zip(nodes, rows, ids):
            vals, lse = row[:k], row[k:]
            tree.draws[node] = NodeDraws(tuple(toks), tuple(vals), tuple(lse))
            if tree.depths[node] >= AHEAD_DEPTH:
                continue
            base = tree.logprobs[node]
            for rank, (v, tok) in enumerate(zip(vals, toks)):
                heapq.heappush(self.pool, (-(base + v / self.tau - lse[g]), node, rank, tok))


def grow_tree(draft: Engine, root: int, lag: Sequence[int], nodes: int, depth: int,
              top_k: int, level_width: int | None = None, tau: float = 1.0,
              grid: Sequence[float] = ()) -> DraftTree:
    """A tree of at most `nodes` tokens (the root included) and `depth` levels below the root,
    grown in series with the draft's cache holding the accepted prefix less `lag`
    (TreeGrower.begin, then grow)."""
    grower = TreeGrower.begin(draft, root, lag, top_k, tau, grid)
    grower.grow(nodes, depth, level_width)
    return grower.tree


def _append(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Run tokens appended at the engine's length; the last one's logits (1, vocab). One token
    goes through decode (a CUDA graph where the engine has them)."""
    if len(tokens) == 1:
        return engine.decode(torch.tensor(tokens, device=engine.device))
    if engine.use_graphs:  # as a chain-shaped tree step, which a captured graph serves
        step = tree_step(list(range(-1, len(tokens) - 1)), engine.length, engine.length,
                         engine.device)
        return engine.forward(tokens, all_logits=True, step=step)[-1:]
    return engine.forward(tokens)
