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

gpt-oss routes otherwise (llama.cpp's SOFTMAX_WEIGHT gating, transformers' GptOssTopKRouter):
the router has a bias, the top k are chosen among the logits and the softmax is taken over
those k only (MoeWeights.gating "topk_softmax"); its experts have biases and a clamped SwiGLU
(`swiglu_oai`).

The router stays float32 at every precision: its top-k is a discrete choice, and a float16
router would pick another expert wherever two probabilities are within its rounding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

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

    def ffn_one(self, ids: list[int], weights: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One token's sum_j weights[j] * ffn(ids[j], h), float32 (1, hidden), for h
        (1, hidden) and its experts in ascending order."""
        ...


# gpt-oss's SwiGLU: the gate clamped from above and the up projection on both sides at 7,
# the gate's sigmoid sharpened by 1.702 (the GELU approximation's constant), and 1 added to up
# (llama.cpp's ggml_swiglu_oai, transformers' GptOssExperts)
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


def swiglu_oai(gate_up: torch.Tensor) -> torch.Tensor:
    """(up + 1) * g * sigmoid(1.702 g), g = min(gate, 7), up clamped to [-7, 7], for
    gate_up = [gate | up] (T, 2 * ffn), computed in float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=OAI_LIMIT)
    up = up.clamp(-OAI_LIMIT, OAI_LIMIT)
    return (up + 1.0) * (gate * torch.sigmoid(OAI_ALPHA * gate))


def expert_sum(pairs: Sequence[tuple[Linear, Linear]], weights: torch.Tensor,
               h: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """sum_j weights[j] * expert_ffn(*pairs[j], h, act) for one row h, float32 (1, hidden),
    added in the order given: a bank's one-token sum where no fused form serves it."""
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    for (gate_up, down), w in zip(pairs, weights):
        out += expert_ffn(gate_up, down, h, act).float() * w
    return out


# A one-token sum of a bank's experts, (gate_up, down) pairs, weights, h, act -> float32
# (1, hidden): expert_sum, or a fused form of it that the loader passes in (weights.cpu's
# native one for packed CPU experts)
OneTokenSum = Callable[[Sequence[tuple["Linear", "Linear"]], torch.Tensor, torch.Tensor, str],
                       torch.Tensor]
# One expert on the rows routed to it, gate_up, down, h, act -> (n, hidden): expert_ffn, or
# the loader's form of it (weights.cpu's native one for packed CPU experts)
ExpertRows = Callable[["Linear", "Linear", torch.Tensor, str], torch.Tensor]


class ResidentExperts:
    """Every expert's linears held on the engine's device: `gate_up[e]` hidden ->
    2 * expert_ffn (gate rows, then up rows) and `down[e]` expert_ffn -> hidden, in any
    format model.llama.Linear covers (the loader builds them as it builds the dense FFN's)."""

    def __init__(self, gate_up: Sequence[Linear], down: Sequence[Linear], act: str = "silu",
                 one_token: OneTokenSum = expert_sum, rows: ExpertRows | None = None):
        """act: the experts' gated product, "silu" (SwiGLU) or "swiglu_oai" (gpt-oss);
        one_token: how a token's experts are summed (ffn_one); rows: how an expert runs on
        its rows (ffn; default expert_ffn)."""
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate/up linears but {len(down)} down linears")
        if act not in ("silu", "swiglu_oai"):
            raise ValueError(f"unknown expert activation {act!r}; expected silu or swiglu_oai")
        self.gate_up = list(gate_up)
        self.down = list(down)
        self.act = act
        self.one_token = one_token
        self.rows = rows or expert_ffn

    @property
    def n_experts(self) -> int:
        return len(self.down)

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.rows(self.gate_up[e], self.down[e], h, self.act)

    def ffn_one(self, ids: list[int], weights: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.one_token([(self.gate_up[e], self.down[e]) for e in ids], weights, h,
                              self.act)


def expert_ffn(gate_up: Linear, down: Linear, h: torch.Tensor, act: str = "silu"
               ) -> torch.Tensor:
    """One expert's FFN on the rows h routed to it: SwiGLU, or gpt-oss's clamped variant."""
    if act == "swiglu_oai":
        return down(swiglu_oai(gate_up(h)).to(h.dtype))
    return down.glu_matmul(gate_up(h))


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
    # the router's bias, float32 (n_experts,): gpt-oss
    router_bias: torch.Tensor | None = None
    # "softmax" (over all experts, then the top k) or "topk_softmax" (the top k logits, then
    # a softmax over them: gpt-oss)
    gating: str = "softmax"


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool = True,
          bias: torch.Tensor | None = None, gating: str = "softmax"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids), each (T, top_k): the experts each row of h (T, hidden) goes to, by
    descending router probability, and their weights (float32)."""
    logits = F.linear(h.to(router.dtype), router, bias)
    if gating == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if gating != "softmax":
        raise ValueError(f"unknown gating {gating!r}; expected softmax or topk_softmax")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_ffn(h: torch.Tensor, moe: MoeWeights) -> torch.Tensor:
    """The FFN output (T, hidden), float32, of the normed hidden states h (T, hidden)."""
    weights, ids = route(h, moe.router, moe.top_k, moe.normalize, moe.router_bias, moe.gating)
    return experts_ffn(h, ids, weights, moe.experts)


def experts_ffn(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                bank: ExpertBank) -> torch.Tensor:
    """sum_j weights[t, j] * bank.ffn(ids[t, j], h[t]) for each row t, float32 (T, hidden).

    Each expert runs once, on all the rows routed to it, experts in ascending order; a row's
    terms are added in that order whatever the batch (one decode token takes the same order
    through the bank's own one-token sum, `ffn_one`: per-op overhead bounds CPU decode)."""
    T, hidden = h.shape
    if T == 1:
        order = torch.argsort(ids[0])
        return bank.ffn_one(ids[0][order].tolist(), weights[0][order].contiguous(), h)
    out = torch.zeros(T, hidden, dtype=torch.float32, device=h.device)
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
