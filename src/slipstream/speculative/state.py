"""What a model's speculative decoding keeps from one generation to the next: a tree sizer per
draft (the costs and acceptance it learned, speculative.sizing), what giving the loaded draft
up would win, and what it did once given up."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from ..runtime.engine import Engine
from ..runtime.generate import TokenSource
from .rounds import speculative_source
from .sizing import ExpertTouch, TreeSizer

# The widest tree the sizer may grow for a CPU target (NODE_CHOICES' two narrowest): a CPU
# pass costs in proportion to its rows (FLOP-bound), and the sizer's first tree of
# START_NODES (64) nodes cost the default model's Q8_0 ~250 ms, against ~11 ms for a plain
# step
CPU_MAX_TREE_NODES = 32


def expert_touch(target: Engine) -> ExpertTouch | None:
    """The target's routing, where it is a mixture of experts (the tree sizer's cost model)."""
    cfg = target.cfg
    return ExpertTouch(cfg.n_experts, cfg.n_experts_used) if cfg.n_experts else None


@dataclass(frozen=True)
class DraftRelease:
    """The loaded draft given up (Model.release_draft): its file's name (or what the
    self-draft was), the layers its memory made resident, and the seconds that took."""

    draft: str
    promoted: list[int]
    seconds: float


@dataclass
class Speculation:
    """A model's speculative decoding across its generations (Model.speculation).

    plain_streamed (CUDA, with a draft file): the layers the model streams when planned
    without the draft (its own plan streams them and more), restored when the draft is given
    up; release_gain: how much faster that plan predicts plain decode (what giving the draft
    up would win, in [1, 2]); released: what giving it up did, once it was."""

    plain_streamed: list[int] | None = None
    release_gain: float = 1.0
    released: DraftRelease | None = None
    _sizers: dict[int, TreeSizer] = field(default_factory=dict, repr=False)

    @property
    def sizers(self) -> Mapping[int, TreeSizer]:
        """The tree sizers, one per draft engine (by id), read-only: their costs, acceptance
        and ranking temperatures' fits (TreeSizer.tau_fits) as learned so far."""
        return MappingProxyType(self._sizers)

    def reset(self) -> None:
        """Forget what the sizers learned: the next generation sizes its trees as a first
        one does (benchmarks measure a first generation so)."""
        self._sizers.clear()

    def source(self, target: Engine, draft: Engine, loaded: bool,
               give_up: Callable[[], object] | None, nodes: int | None, depth: int | None,
               ahead: int | None) -> TokenSource:
        """The token source of a speculative generation with `draft` (`loaded`: the draft
        load() attached, which `give_up` releases; a draft passed in for one generation
        belongs to the caller, and is weighed against plain decode as it is)."""
        # one sizer per draft, kept: costs and acceptance carry over between generations
        sizer = self._sizers.setdefault(id(draft), TreeSizer(experts=expert_touch(target)))
        if target.device.type == "cpu":
            sizer.max_nodes = min(sizer.max_nodes, CPU_MAX_TREE_NODES)
        sizer.plain_gain = self.release_gain if loaded else 1.0
        return speculative_source(draft, nodes=nodes, depth=depth, sizer=sizer,
                                  give_up=give_up if loaded else None, ahead=ahead)
