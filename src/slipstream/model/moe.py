"""The mixture-of-experts FFN (Qwen3-MoE, Mixtral): a router picks a few experts per token,
each expert is a SwiGLU FFN of its own, and the token's output is their outputs weighted by
the router.

Routing, as llama.cpp's build_moe_ffn runs it for both families (softmax gating, norm_w on)
and transformers' Qwen3MoeTopKRouter / MixtralSparseMoeBlock do:
    p = softmax(h @ router^T)            over all experts, float32
    top-k of p                            the k = expert_used_count largest
    w = p[top] / sum(p[top])              renormalised to sum to 1
    out = sum_j w_j * down_j(silu(gate_j h) * up_j h)

The experts are reached through an ExpertBank: `ffn(e, rows)` is expert e's FFN on the rows
routed to it. ResidentExperts holds every expert's linears on the engine's device; a bank that
places experts elsewhere (VRAM, RAM, disk) gives the same interface, and this module does not
change.

The router stays float32 at every precision: its top-k is a discrete choice, and a float16
router would pick another expert wherever two probabilities are within its rounding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # type hints only: model.llama imports this module
    from .llama import Linear


class ExpertBank(Protocol):
    """A layer's experts, each a SwiGLU FFN hidden -> hidden."""

    @property
    def n_experts(self) -> int: ...

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's FFN on the rows h (n, hidden) routed to it: (n, hidden)."""
        ...


class ResidentExperts:
    """Every expert's linears held on the engine's device: `gate_up[e]` hidden ->
    2 * expert_ffn (gate rows, then up rows) and `down[e]` expert_ffn -> hidden, in any
    format model.llama.Linear covers (the loader builds them as it builds the dense FFN's)."""

    def __init__(self, gate_up: Sequence[Linear], down: Sequence[Linear]):
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate/up linears but {len(down)} down linears")
        self.gate_up = list(gate_up)
        self.down = list(down)

    @property
    def n_experts(self) -> int:
        return len(self.down)

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.down[e].glu_matmul(self.gate_up[e](h))


@dataclass
class MoeWeights:
    """A layer's mixture-of-experts FFN: the router, float32 (n_experts, hidden), the experts,
    and how many of them each token uses."""

    router: torch.Tensor
    experts: ExpertBank
    top_k: int
    # renormalise the top-k weights to sum to 1 (llama.cpp's norm_w; on for every family
    # slipstream runs: the negative controls turn it off)
    normalize: bool = True


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids), each (T, top_k): the experts each row of h (T, hidden) goes to, by
    descending router probability, and their weights (float32)."""
    logits = F.linear(h.to(router.dtype), router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_ffn(h: torch.Tensor, moe: MoeWeights) -> torch.Tensor:
    """The FFN output (T, hidden), float32, of the normed hidden states h (T, hidden)."""
    weights, ids = route(h, moe.router, moe.top_k, moe.normalize)
    return experts_ffn(h, ids, weights, moe.experts)


def experts_ffn(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                bank: ExpertBank) -> torch.Tensor:
    """sum_j weights[t, j] * bank.ffn(ids[t, j], h[t]) for each row t, float32 (T, hidden).

    Each expert runs once, on all the rows routed to it, experts in ascending order; a row's
    terms are added in that order whatever the batch (one decode token takes the same order
    through its own short path: per-op overhead bounds CPU decode)."""
    T, hidden = h.shape
    out = torch.zeros(T, hidden, dtype=torch.float32, device=h.device)
    if T == 1:
        order = torch.argsort(ids[0])
        for e, w in zip(ids[0][order].tolist(), weights[0][order]):
            out += bank.ffn(e, h).float() * w
        return out
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=bank.n_experts).tolist()
    rows = order // k
    scale = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            r = rows[start:start + n]
            y = bank.ffn(e, h.index_select(0, r)).float()
            out.index_add_(0, r, y * scale[start:start + n, None])
            start += n
    return out
