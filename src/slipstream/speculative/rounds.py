"""Lossless tree speculative decoding, as a token source for `runtime.generate`.

A draft (an Engine with the target's vocabulary: a smaller model with a KV cache of its own,
or a self-draft writing into the target's) guesses a tree of continuations of the pending
token; the target scores the whole tree in one forward (a tree step, `model.step.tree_step`);
then the user's Sampler walks the tree from its root, drawing
every token from the target's own logits at the node reached, and descends while the token
drawn is one the draft guessed. Every emitted token is thus drawn from the target's conditional
distribution given everything before it, exactly as plain decoding draws it, whatever the
sampling settings (penalties included: the history is the prompt plus every emitted token); the
draft only decides how many tokens one target pass yields. At temperature 0 it is greedy
decoding; with a seed, the Sampler's generator is used once per token in the same order as in
plain decoding, so equal logits give equal tokens.

The tree (SpecExec style, speculative.tree) is deterministic: the most probable
continuations by the draft's cumulative log-probability (at a temperature fitted to the
target's draws, speculative.calibration, starting from the sampling temperature, no lower
than 0.3: draft_tree.tree_tau), grown level by level with one draft forward per level over the
new nodes only. With `ahead`, the draft grows it on past what the
target verified, after the pass; where the walk then ends at a token grown ahead, the subtree
below it is the next tree, topped up in series to the round's depth. On the default model's
Q8_0/Q4_0 pair that does not pay yet (CPU, 64-node trees, greedy): fresh trees give 5.22
tokens per pass for 7.33 draft forwards in series; reused trees without the top-up 3.92 for
2.42 (67% of trees reused), with it 4.70 for 6.70 (25%). At the 70B's measured costs (a 0.485 s pass, 10 ms levels) the fresh
trees win either way, and hiding the draft entirely would gain at most its ~13% of a round.
On CUDA, with a draft of its own, the growth runs beside the target's streamed pass on a
stream of the draft's, launched from the same host thread (`Speculator._verify`: a second
launching thread starved the target's, passes 0.497 -> 0.938 s on the H200); on the
CPU after the pass. It is off unless asked for: on GPUs it has won and lost on the default
model streamed from disk (README, `generate(spec_ahead=K)`), and random 70B weights accept
nothing for it to gain.

Invariant between rounds, with L = len(prompt) + emitted - 1:
  * the target's cache holds the accepted prefix: the prompt and every emitted token but the
    last, which is the pending root (sampled, not yet run through either model);
  * the draft's cache holds the same slots except its `lag`: accepted tokens it never ran (a
    tree leaf the walk descended into, or roots of plain steps), so draft.length + len(lag) == L
    (at most one token after a tree round; a plain step, which the sizer chooses where trees
    do not pay, adds its root). The next growth runs lag + root in one forward;
  * or, where the tree grown ahead holds the pending root: the draft's cache holds the
    accepted prefix, then the root and the nodes of its subtree that ran (`Speculator.grown`).
  * A draft that shares the target's KV cache (`Engine.self_draft(share_kv=True)`, the low-bit
    copy) has no cache of its own: the prefix it reads is the target's, so it has no prefill
    and no lag; it writes its tree from the root's slot on, and the verify pass then writes
    the target's entries over those slots before the walk compacts them. Nothing is grown
    ahead for it (that would write over the verified entries before the walk).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..errors import BadArgument, DraftMismatch
from ..model import ring_size, tree_step
from .tree import DraftTree, TreeGrower, grow_tree, tree_tau
from ..runtime.engine import Engine
from ..runtime.generate import GenerationStats, TokenSource, decode_steps
from ..runtime.sampler import Sampler
from .sizing import PROMPT_POSITIONS, TreeSizer
from .calibration import TauFit

__all__ = ["SpecStats", "Speculator", "check_vocab", "grow_tree", "keep", "speculative_source",
           "walk"]

# Drafted tokens below the root on the longest branch: the trees grown before the sizer has
# measured anything (and those that explore or settle a draft) go DEFAULT_DEPTH deep, and the
# sizer may choose up to MAX_DEPTH where the measured acceptance and costs say deeper pays. A
# streamed 70B's pass costs the same for 1 node as for 512 and a draft level ~11 ms against
# its ~0.44 s (H200), so a good draft's trees pay deep: the
# published 8-13 tokens a pass need depths past 8 (at most depth + 1 tokens come of a pass),
# and the CPU table's 135M pair gave 6.66 tokens a pass at depth 16 against 6.15 at 8
# (256 nodes, greedy, precision "exact")
DEFAULT_DEPTH = 8
MAX_DEPTH = 16
DEFAULT_TOP_K = 8  # children considered per expanded node
# Nodes one draft level runs on CUDA. Measured on the H200 (synthetic 8B Q4_K, captured
# graphs): a level of 1/2/4 nodes costs 4.6/7.7/10.0 ms through the fused GEMVs, and
# 8/16/32/64 nodes 10.7/10.3/11.0/13.8 ms through kernels.qgemm's wide kernel (16.5 ms at 32
# through a kernel of one program per slot): 8 times the nodes of a 4-wide level for 1.1
# times its cost, so a 256-node tree's levels run 32 nodes each rather than 4
CUDA_LEVEL_WIDTH = 32
# Nodes a level grown ahead runs: CUDA's level width, on the CPU too, so that outcomes compare
AHEAD_WIDTH = CUDA_LEVEL_WIDTH


def prompt_agreement(target_logits: torch.Tensor, draft_logits: torch.Tensor,
                     top_k: int) -> tuple[int, int]:
    """(hits, trials): of the rows both give (the same positions), those where the target's
    top token is among the draft's `top_k` most likely, the candidates a tree's first level
    takes."""
    rows = min(target_logits.shape[0], draft_logits.shape[0])
    if rows == 0:
        return 0, 0
    choice = target_logits[-rows:].argmax(dim=-1).to(draft_logits.device)
    top = draft_logits[-rows:].topk(min(top_k, draft_logits.shape[-1]), dim=-1).indices
    return int((top == choice[:, None]).any(dim=-1).sum()), rows


def walk(tree: DraftTree, logits: torch.Tensor, sampler: Sampler, history: torch.Tensor,
         rows: dict[int, int] | None = None
         ) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """Draw tokens from the target's logits down the tree: at each node the Sampler draws with
    the history so far; a drawn token the draft guessed, among the nodes the target verified,
    is a child to descend into, any other ends the walk (and is the next root).

    rows: each verified node's row of `logits` (None: every node, node i at row i).
    Returns the accepted path (node indices from the root), the emitted tokens (0-d, one per
    path node: the children descended into, then the last draw) and the history with them."""
    node, path, out = 0, [0], []
    while True:
        token = sampler(logits[node if rows is None else rows[node]], history)
        history = torch.cat((history, token.view(1)))
        out.append(token)
        child = tree.children[node].get(int(token))
        if child is None or (rows is not None and child not in rows):
            return path, out, history
        node = child
        path.append(node)


def keep(engine: Engine, start: int, path: Sequence[int]) -> None:
    """Keep the nodes `path` (indices of a tree written from slot `start`) as slots start..:
    the leading nodes already in place stay where they are, the rest are compacted."""
    lead = 0
    while lead < len(path) and path[lead] == lead:
        lead += 1
    if lead == len(path):
        engine.truncate(start + lead)
    else:
        engine.compact([start + i for i in path[lead:]], start + lead)


@dataclass
class SpecStats:
    """Per-generation figures, written to GenerationStats.extra with a "spec_" prefix."""

    target_passes: int = 0  # verify passes after the prefill
    tokens: int = 0  # tokens those passes emitted
    accepted: list[int] = field(default_factory=list)  # [a]: passes accepting a drafted tokens
    tree_nodes: int = 0
    draft_forwards: int = 0  # in series, before target passes
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_prefill_s: float = 0.0
    plain_steps: int = 0  # passes of the root alone (the sizer found no tree worth its cost)
    given_up_at: int | None = None  # the pass after which the draft was given up
    ahead_forwards: int = 0  # draft forwards grown past the verified nodes (`ahead`)
    ahead_s: float = 0.0  # the time they took
    ahead_trees: int = 0  # trees that were grown ahead, in the round before them
    ahead_beside: int = 0  # of ahead_forwards: grown on the draft's stream beside the pass
    plain_after_give_up: int = 0  # of plain_steps: decode steps once the draft was given up

    def record(self, tree_len: int, accepted: int, emitted: int) -> None:
        self.target_passes += 1
        self.plain_steps += tree_len == 1
        self.tokens += emitted
        self.tree_nodes += tree_len
        while len(self.accepted) <= accepted:
            self.accepted.append(0)
        self.accepted[accepted] += 1

    def record_plain(self) -> None:
        """A plain decode step after the draft was given up (timed with the generation, not
        as a verify pass: it is not synchronised)."""
        self.record(1, 0, 1)
        self.plain_after_give_up += 1

    def write(self, stats: GenerationStats) -> None:
        passes = max(self.target_passes, 1)
        stats.extra.update(
            spec_target_passes=self.target_passes,
            spec_tokens_per_pass=self.tokens / passes,
            spec_accepted_hist=list(self.accepted),
            spec_tree_nodes_mean=self.tree_nodes / passes,
            spec_draft_forwards=self.draft_forwards,
            spec_draft_s=self.draft_s, spec_verify_s=self.verify_s,
            spec_draft_prefill_s=self.draft_prefill_s,
            spec_plain_steps=self.plain_steps, spec_draft_given_up_at=self.given_up_at,
            spec_ahead_forwards=self.ahead_forwards, spec_ahead_s=self.ahead_s,
            spec_ahead_trees=self.ahead_trees, spec_ahead_beside=self.ahead_beside,
            spec_plain_after_give_up=self.plain_after_give_up,
            # the passes verify_s times: the plain steps after the give-up are not timed
            spec_verify_passes=self.target_passes - self.plain_after_give_up)


class Speculator:
    """One generation's speculative state over a target and a draft engine: the history (prompt
    plus emitted tokens), the pending root, the draft's lag (see the module's invariant), and
    the tree grown ahead for the pending root, if the last pass's outcome was in it."""

    def __init__(self, target: Engine, draft: Engine, sampler: Sampler,
                 nodes: int | None = None, depth: int | None = None,
                 top_k: int = DEFAULT_TOP_K, stats: SpecStats | None = None,
                 sizer: TreeSizer | None = None,
                 give_up: Callable[[], None] | None = None, ahead: int | None = None):
        """nodes: the tree's node budget (root included), depth: drafted tokens below the
        root; each None lets `sizer` choose it every round (the depth up to MAX_DEPTH, 0
        being a plain step). give_up: called once if the sizer concludes the draft does not
        pay (TreeSizer.gives_up); the draft is not used after that. ahead: draft levels
        grown past the verified nodes after each target pass, so that the next tree may be
        grown already (None or 0: none)."""
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise DraftMismatch(f"the draft has {draft.cfg.vocab_size} logits per token and "
                                f"the target {target.cfg.vocab_size}: they need one vocabulary")
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int)
                                  or ahead < 0):
            raise BadArgument(f"speculative ahead={ahead!r} is invalid: must be an integer "
                              f">= 0")
        self.shared_kv = draft.shares_kv(target)
        if self.shared_kv and ahead:
            raise BadArgument(f"speculative ahead={ahead} does not combine with a draft that "
                              f"writes into the target's KV cache (the low-bit copy): growing "
                              f"past the verified nodes would overwrite their entries")
        self.target, self.draft, self.sampler = target, draft, sampler
        self.top_k = top_k
        self.sizer = sizer if sizer is not None else TreeSizer()
        # ranks the trees' candidates: fitted to the walks, one fit per sampling temperature,
        # kept with the sizer's other lessons about this draft
        temperature = float(sampler.params.temperature)
        self.fit = self.sizer.tau_fits.setdefault(temperature, TauFit(tree_tau(temperature)))
        self.tau = self.fit.tau
        self.sizer.max_depth = MAX_DEPTH if depth is None else depth
        self.sizer.probe_depth = DEFAULT_DEPTH
        self.sizer.fixed_nodes, self.sizer.fixed_depth = nodes, depth
        self.level_width = CUDA_LEVEL_WIDTH if draft.device.type == "cuda" else None
        self.ahead = ahead
        self.give_up = give_up
        self.given_up = False
        self.stats = stats if stats is not None else SpecStats()
        self.history = torch.zeros(0, dtype=torch.long, device=target.device)
        self.root: torch.Tensor | None = None
        self.lag: list[int] = []
        self.grown: TreeGrower | None = None  # the pending root's tree, grown ahead
        self._draft_stream: torch.cuda.Stream | None = None  # growing beside the pass

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Both caches hold the prompt; the first token (0-d) is drawn and pending."""
        self.target.reset()
        if not self.shared_kv:
            self.draft.reset()
        self.history = torch.tensor(prompt, dtype=torch.long, device=self.target.device)
        # the last positions' logits of both models: how often the draft's candidates hold
        # the target's choice there tells the sizer early whether the draft can pay
        # (spec_sizing.PROMPT_POSITIONS); not where nothing would act on it (a tree size the
        # user fixed, no way to give the draft up) or the draft reads the target's cache
        weighed = not self.shared_kv and self.give_up is not None and \
            self.sizer.fixed_nodes is None and self.sizer.fixed_depth is None
        last = min(len(prompt), PROMPT_POSITIONS) if weighed else 1
        tail = self.target.forward(prompt, last=last)
        self.root = self.sampler(tail[-1], self.history)
        self.history = torch.cat((self.history, self.root.view(1)))
        if not self.shared_kv:  # a shared cache holds the target's prefix already
            t = time.perf_counter()
            drafted = self.draft.forward(prompt, last=last)
            self.stats.draft_prefill_s += _since(t, self.draft.device)
            if weighed:
                self.sizer.observe_prompt(*prompt_agreement(tail, drafted, self.top_k))
        self.lag = []
        self.grown = None
        return self.root

    def round(self, most: int) -> list[torch.Tensor]:
        """One target pass: emit between 1 and `most` tokens (0-d), the last one pending."""
        target, draft, root = self.target, self.draft, self.root
        start = target.length  # the root's slot in both caches
        nodes, depth = self.sizer.choose()
        if not self.given_up and self.give_up is not None and self.sizer.gives_up:
            self.given_up = True
            self.stats.given_up_at = self.stats.target_passes
            self.give_up()
        # the verify pass needs `width` free slots in the target's cache, growth as many in
        # the draft's (and the lag's), and at most the target's prefill chunk of activations
        # (what its plan reserved VRAM for); a round emits at most levels + 1 tokens
        width = 1 if self.given_up else min(nodes, target.prefill_chunk, target.ctx - start,
                                            draft.ctx - start)
        levels = min(depth, most - 1, width - 1)
        grown, self.grown = self.grown, None
        t = time.perf_counter()
        if levels < 1:
            # a plain step (the sizer's choice, the last token, or the end of the context):
            # the draft sits it out and catches up on the next tree
            if grown is not None:  # the root ran in the draft ahead: keep it, drop the rest
                draft.truncate(start + 1)
            elif not self.shared_kv:
                self.lag.append(int(root))
            tree, verify, rows = DraftTree(int(root)), [0], {0: 0}
            logits = target.decode(root.view(1))
        else:
            if grown is None:
                grown = TreeGrower.begin(draft, int(root), self.lag, self.top_k, self.tau,
                                         self.fit.grid_to_keep)
                grown.grow(width, levels, self.level_width)
                self.lag = []
                forwards = grown.tree.forwards
            else:
                self.stats.ahead_trees += 1
                forwards = grown.top_up(width, levels, self.level_width)
            if forwards:  # the draft's work in series, before the pass
                t_draft = time.perf_counter()  # growth ended on a host read of the logits
                self.stats.draft_forwards += forwards
                self.stats.draft_s += t_draft - t
                self.sizer.observe_levels(forwards, t_draft - t)
                t = t_draft
            tree = grown.tree
            verify = grown.snapshot(width, levels)
            rows = {node: row for row, node in enumerate(verify)}
            logits = self._verify(grown, verify, rows, start)
        path, tokens, self.history = walk(tree, logits, self.sampler, self.history, rows)
        keep(target, start, [rows[i] for i in path])
        if len(verify) > 1:
            # a shared cache holds the target's path now, compacted: nothing to keep or reuse
            self.grown = None if self.shared_kv else grown.reroot(path, int(tokens[-1]))
            if self.grown is None and not self.shared_kv:
                ran = [i for i in path if tree.ran[i]]  # a prefix: the path's ancestors ran
                keep(draft, start, ran)
                self.lag = [tree.tokens[i] for i in path[len(ran):]]
            self.sizer.observe_walk(max(tree.depths[i] for i in verify), len(path) - 1)
            self.fit.observe_walk(tree.draws, path)
            self.fit.observe_tree(tree, verify, path)
            self.tau = self.fit.tau
        verify_s = _since(t, target.device)
        self.stats.verify_s += verify_s
        self.sizer.observe_pass(len(verify), verify_s)
        self.stats.record(len(verify), len(path) - 1, len(tokens))
        self.root = tokens[-1]
        return tokens

    def _verify(self, grown: TreeGrower, verify: list[int], rows: dict[int, int],
                start: int) -> torch.Tensor:
        """The target's pass over the nodes `verify` of the tree (node -> logits row: `rows`);
        with `ahead`, the draft grows the tree on past them, for the next round: beside the
        pass where the draft can run on a CUDA stream of its own (`_beside`), else after it."""
        tree = grown.tree
        parents = [rows[tree.parents[i]] if i else -1 for i in verify]
        step = tree_step(parents, start, start, self.target.device)
        tokens = [tree.tokens[i] for i in verify]
        if not self.ahead:
            return self.target.forward(tokens, all_logits=True, step=step)
        left = self.ahead
        stream = self._beside()

        def grow(go_on: Callable[[], bool], levels: int) -> int:
            nonlocal left
            t = time.perf_counter()
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                done = grown.ahead(go_on, AHEAD_WIDTH, min(levels, left))
            left -= done
            self.stats.ahead_forwards += done
            if stream is None:  # in series: its time is the draft's, device included
                self.stats.ahead_s += _since(t, self.draft.device)
            else:  # beside the pass: the host's, which is what it may cost the pass
                self.stats.ahead_s += time.perf_counter() - t
                self.stats.ahead_beside += done
            return done

        if stream is None:
            logits = self.target.forward(tokens, all_logits=True, step=step)
            grow(lambda: True, left)  # in series, after the pass
            return logits
        # The draft's stream starts after what the draft's cache holds so far (the levels
        # grown in series, a compaction); the pass's layers are enqueued on the current
        # stream. While a streamed layer's read has not landed, the host grows a level
        # instead of waiting; once every layer is enqueued, it grows levels until the pass
        # is done. No thread: a second Python thread launching the draft's kernels starved
        # the one launching the target's (passes 0.497 -> 0.938 s on the H200).
        current = torch.cuda.current_stream(self.target.device)
        stream.wait_stream(current)
        logits = self.target.forward(tokens, all_logits=True, step=step,
                                     idle=lambda: left > 0 and grow(lambda: True, 1) > 0)
        passed = torch.cuda.Event()
        passed.record(current)
        grow(lambda: not passed.query(), left)
        current.wait_stream(stream)  # the walk's compaction of the draft's cache comes next
        return logits

    def _beside(self) -> "torch.cuda.Stream | None":
        """The CUDA stream the draft grows on beside the target's pass, or None where it
        cannot: on the CPU (one set of cores), and for a self-draft sharing the target's
        layer store (a store serves one pass at a time: its ring, timing and hybrid mode)."""
        if self._draft_stream is None and self.draft.device.type == "cuda" and \
                self.target.device.type == "cuda" and not self._shares_store():
            self._draft_stream = torch.cuda.Stream(self.draft.device)
        return self._draft_stream

    def _shares_store(self) -> bool:
        mine = {id(st.store) for st in self.target.stages}
        return any(id(st.store) in mine for st in self.draft.stages)


def speculative_source(draft: Engine, nodes: int | None = None, depth: int | None = None,
                       top_k: int = DEFAULT_TOP_K, sizer: TreeSizer | None = None,
                       give_up: Callable[[], None] | None = None, ahead: int | None = None
                       ) -> TokenSource:
    """A token source that decodes with `draft` guessing trees of at most `nodes` tokens (the
    root included: the target's verify pass is `nodes` wide) and `depth` drafted tokens deep
    (each None: chosen every round by `sizer` from measured costs, speculative.sizing),
    from the `top_k` most probable children of each node. Lossless: see the module's text.
    A sizer passed in carries what it learned across generations; `give_up` is called if it
    concludes the draft does not pay, and `ahead` sets the levels grown ahead after each
    target pass (Speculator). Writes SpecStats into the
    GenerationStats' extra, also when the generation stops early."""
    for name, value in (("nodes", nodes), ("depth", depth), ("top_k", top_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise BadArgument(f"speculative {name}={value!r} is invalid: must be an integer "
                              f">= 1")

    def source(engine: Engine, prompt: list[int], sampler: Sampler, budget: int,
               stats: GenerationStats) -> Iterator[torch.Tensor]:
        most = ring_size.RING_TREE
        if nodes is not None and nodes > most and any(
                st.kv.rings for e in (engine, draft) for st in e.stages):
            raise BadArgument(f"speculative nodes={nodes} is more than a sliding-window "
                              f"layer's KV ring can roll back ({most}, model.ring); use at "
                              f"most {most}")
        spec = Speculator(engine, draft, sampler, nodes, depth, top_k, sizer=sizer,
                          give_up=give_up, ahead=ahead)
        try:
            t = time.perf_counter()
            root = spec.prefill(prompt)
            stats.prefill_s = time.perf_counter() - t
            yield root
            emitted = 1
            while emitted < budget and not spec.given_up:
                for token in spec.round(budget - emitted):
                    emitted += 1
                    yield token
            # the draft given up: the rest is plain decoding's own loop (one step queued
            # ahead of the host), not rounds that each end in a sync
            for token in decode_steps(engine, spec.root, spec.history, sampler,
                                      budget - emitted):
                spec.stats.record_plain()
                yield token
        finally:
            spec.stats.write(stats)

    return source


def _since(t: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def check_vocab(target_tokens: Sequence[str], draft_tokens: Sequence[str], target_name: str,
                draft_name: str) -> None:
    """Raise DraftMismatch unless the two token lists (tokenizer.ggml.tokens) are equal."""
    if list(target_tokens) == list(draft_tokens):
        return
    n, m = len(target_tokens), len(draft_tokens)
    first = next((i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)) if a != b),
                 min(n, m))
    where = (f"token {first} is {target_tokens[first]!r} in {target_name} but "
             f"{draft_tokens[first]!r} in {draft_name}" if first < min(n, m) else
             f"the lists agree up to token {first}")
    raise DraftMismatch(f"the draft {draft_name} does not share the vocabulary of "
                        f"{target_name} ({n} tokens against {m}; {where}); a draft must use "
                        f"the target's tokenizer")
