"""Pre-gating: while layer i computes, guess layer i+1's experts and read its cold ones ahead.

A mixture of experts placed expert by expert on the CPU (weights.expert_tiers) reads a cold
expert from the file when a token routes to it, on the critical path. Consecutive layers'
residual streams differ little (each block adds its attention's and FFN's outputs to it), so
layer i+1's router applied to layer i's stream, normed as layer i+1 norms it, picks mostly the
experts layer i+1 will pick (Pre-gated MoE, Hwang et al. 2024; AdapMoE, Zhong et al. 2024;
llama.cpp has no such path). The guess's cold experts are read on the expert file's
background thread (ExpertFile.read_ahead) while layer i computes; layer i+1's bank still
routes on its real router output, so a wrong guess costs only a wasted read, and a right
one's bytes are the same bytes a miss reads (the same bits).

Where the guess is made (`stage`): "input", layer i's block input, gives the read the whole of
layer i to run in; "attention", layer i's stream after its attention, is one step closer to
layer i+1's and gives it layer i's FFN only. benchmarks/expert_ahead.py measures both."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import envs
from ..errors import BadArgument
from ..model.llama import LayerWeights, moe_router_input
from ..model.moe import MoeWeights, route
from ..modelfile.config import ModelConfig
from .expert_tiers import TieredExperts

# where a layer's hook guesses the next layer's experts (model.moe.MoeWeights.ahead)
STAGES = ("input", "attention")


class Pregate:
    """Layer i's hook: at `stage`, layer i+1's router on its own input made from layer i's
    stream x (`router_input`), the union of the rows' top-k experts read ahead into layer
    i+1's bank where they are cold."""

    def __init__(self, stage: str, router_input: Callable[[torch.Tensor], torch.Tensor],
                 nxt: MoeWeights):
        if stage not in STAGES:
            raise BadArgument(f"read-ahead stage {stage!r} is invalid: one of "
                              f"{', '.join(STAGES)}")
        assert isinstance(nxt.experts, TieredExperts)
        self.stage = stage
        self.router_input = router_input
        self.nxt = nxt
        self.bank: TieredExperts = nxt.experts

    def __call__(self, x: torch.Tensor, stage: str) -> None:
        if stage != self.stage:
            return
        m = self.nxt
        _, ids = route(self.router_input(x), m.router, m.top_k, m.normalize, m.router_bias,
                       m.gating, m.selection_bias, m.groups, m.groups_used, m.scale)
        self.bank.read_ahead(sorted(set(ids.reshape(-1).tolist())))


def wire(cfg: ModelConfig, layers: Sequence[LayerWeights | None],
         stage: str | None = None) -> int:
    """Sets each layer's hook to guess the next layer's experts, where both are mixtures of
    experts and the next one's are tiered (some on disk). `stage`: where to guess (STAGES),
    "off" for nowhere; None: SLIPSTREAM_EXPERT_AHEAD. Returns how many hooks were set."""
    stage = envs.get("SLIPSTREAM_EXPERT_AHEAD") if stage is None else stage
    n = 0
    for i in range(len(layers) - 1):
        w, nxt = layers[i], layers[i + 1]
        if w is None or w.moe is None:
            continue
        w.moe.ahead = None
        if stage == "off" or nxt is None or nxt.moe is None or \
                not isinstance(nxt.moe.experts, TieredExperts) or \
                nxt.moe.experts.slots == nxt.moe.experts.n_experts:
            continue
        ncfg = cfg.layer(i + 1)

        def router_input(x: torch.Tensor, ncfg=ncfg, nxt=nxt) -> torch.Tensor:
            return moe_router_input(ncfg, nxt, x)
        w.moe.ahead = Pregate(stage, router_input, nxt.moe)
        n += 1
    return n
