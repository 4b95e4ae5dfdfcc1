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
routed to it, `mix` the routed sum over a pass's rows. ResidentExperts holds every expert's
linears on the engine's device; a bank that places experts elsewhere (VRAM, RAM, disk) gives
the same interface, and this module does not change. On CUDA the bank stacks each
projection's experts in one packed weight (weights.routed_experts), whose `mix` reads the
routed ids on the device, so a decode step has no host sync and a CUDA graph holds it.

gpt-oss routes otherwise (llama.cpp's SOFTMAX_WEIGHT gating, transformers' GptOssTopKRouter):
the router has a bias, the top k are chosen among the logits and the softmax is taken over
those k only (MoeWeights.gating "topk_softmax"); its experts have biases and a clamped SwiGLU
(`swiglu_oai`).

GLM-4.5 and DeepSeek-V3 route otherwise again (llama.cpp's SIGMOID gating with exp_probs_b,
transformers' Glm4MoeTopkRouter / DeepseekV3TopkRouter), in named pieces a MoeWeights turns on:
    p = sigmoid(h @ router^T)                                        gating "sigmoid"
    s = p + selection_bias                 the choice only; the weights stay p (select_experts)
    groups: the experts in `groups` equal groups, each scored by the sum of its two best s,
            the `groups_used` best groups kept and the others' s set to -inf  (select_groups)
    top-k of s; w = p[top], renormalised (normalize), then times `scale`
    out += down_s(silu(gate_s h) * up_s h)                 the shared expert, every token
llama.cpp's build_moe_ffn applies groups to any family whose file sets
`expert_group_count` > 1, so they are a piece of their own, not DeepSeek's.

Gemma 4's 26B-A4B (llama.cpp's gemma4 graph, transformers' Gemma4TextDecoderLayer) runs a
dense GeGLU MLP beside the experts, each branch normed on its own, from the residual stream x
rather than from one normed input:
    r = rms(x) / sqrt(hidden) * router_scale       the router's input (router_input)
    top-k of softmax(r @ router^T), renormalised, times expert_scale[top]  (per-expert scale)
    moe = post_norm_2(sum_j w_j * down_j(gelu(gate_j e) * up_j e)),  e = pre_norm_2(x)
    mlp = post_norm_1(mlp(ffn_norm(x)))            the dense MLP as the shared expert
    out = mlp + moe                                 (the block's post_ffw_norm comes after)
The named pieces: MoeWeights.router_scale, expert_scale, expert_norm, expert_post_norm, and a
SharedExpert with an activation and a post-norm of its own.

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

    def mix(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The rows' routed experts' outputs weighted and summed, float32 (T, hidden), for
        ids and weights (T, top_k) from `route`: experts_ffn over `ffn`, or a bank's own
        device path (weights.routed_experts: one launch per projection for every slot)."""
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
# A bank's whole mix of many rows at once, gate_up and down (every expert's), h, ids,
# weights, act -> float32 (T, hidden), or None where it does not serve them (then
# experts_ffn): the loader's fused form (weights.cpu's native one for packed CPU experts)
ExpertMix = Callable[[Sequence["Linear"], Sequence["Linear"], torch.Tensor, torch.Tensor,
                      torch.Tensor, str], "torch.Tensor | None"]


class ResidentExperts:
    """Every expert's linears held on the engine's device: `gate_up[e]` hidden ->
    2 * expert_ffn (gate rows, then up rows) and `down[e]` expert_ffn -> hidden, in any
    format model.llama.Linear covers (the loader builds them as it builds the dense FFN's)."""

    def __init__(self, gate_up: Sequence[Linear], down: Sequence[Linear], act: str = "silu",
                 one_token: OneTokenSum = expert_sum, rows: ExpertRows | None = None,
                 many: ExpertMix | None = None):
        """act: the experts' gated product, "silu" (SwiGLU), "swiglu_oai" (gpt-oss) or
        "gelu_tanh" (GeGLU: Gemma 4);
        one_token: how a token's experts are summed (ffn_one); rows: how an expert runs on
        its rows (ffn; default expert_ffn); many: how a pass of several rows is mixed where
        it can be in one go (mix; default experts_ffn over ffn)."""
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} gate/up linears but {len(down)} down linears")
        if act not in EXPERT_ACTS:
            raise ValueError(f"unknown expert activation {act!r}; expected one of "
                             f"{', '.join(EXPERT_ACTS)}")
        self.gate_up = list(gate_up)
        self.down = list(down)
        self.act = act
        self.one_token = one_token
        self.rows = rows or expert_ffn
        self.many = many

    @property
    def n_experts(self) -> int:
        return len(self.down)

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.rows(self.gate_up[e], self.down[e], h, self.act)

    def ffn_one(self, ids: list[int], weights: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.one_token([(self.gate_up[e], self.down[e]) for e in ids], weights, h,
                              self.act)

    def mix(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.many is not None and h.shape[0] > 1:
            out = self.many(self.gate_up, self.down, h, ids, weights, self.act)
            if out is not None:
                return out
        return experts_ffn(h, ids, weights, self)


# the experts' gated products: SwiGLU, gpt-oss's clamped SwiGLU, GeGLU (Gemma 4)
EXPERT_ACTS = ("silu", "swiglu_oai", "gelu_tanh")


def expert_ffn(gate_up: Linear, down: Linear, h: torch.Tensor, act: str = "silu"
               ) -> torch.Tensor:
    """One expert's FFN on the rows h routed to it: SwiGLU, gpt-oss's clamped variant, or
    GeGLU (the tanh approximation of GELU, as Gemma's dense FFN)."""
    if act == "swiglu_oai":
        return down(swiglu_oai(gate_up(h)).to(h.dtype))
    return down.glu_matmul(gate_up(h), act=act)


# An RMSNorm, (rows, weight or None for none) -> rows normed: the block's (model.llama), passed
# in so that the norms here round as the block's own do
Norm = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass
class SharedExpert:
    """An FFN every token takes beside the routed experts, its output added unweighted:
    `gate_up` hidden -> 2 * width (gate rows, then up rows), `down` width -> hidden. GLM-4.5's
    and DeepSeek's shared experts (SwiGLU; llama.cpp's ffn_*_shexp, transformers'
    shared_experts), or Gemma 4's dense MLP (GeGLU, its output normed by `post_norm`,
    post_ffw_norm_1, before the add)."""

    gate_up: Linear
    down: Linear
    act: str = "silu"
    post_norm: torch.Tensor | None = None  # (hidden,)
    # Qwen3.5-MoE: the output times sigmoid(h . gate) per token, float32 (hidden,)
    # (llama.cpp's ffn_gate_inp_shexp; transformers' shared_expert_gate)
    gate: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
        y = expert_ffn(self.gate_up, self.down, h, self.act)
        if self.gate is not None:
            y = y.float() * torch.sigmoid(h.float() @ self.gate)[:, None]
        if self.post_norm is None:
            return y
        assert norm is not None, "a shared expert with a post-norm needs the block's norm"
        return norm(y, self.post_norm)


@dataclass
class MoeWeights:
    """A layer's mixture-of-experts FFN: the router, float32 (n_experts, hidden), the experts,
    and how many of them each token uses."""

    router: torch.Tensor
    experts: ExpertBank
    top_k: int
    # renormalise the top-k weights to sum to 1 (llama.cpp's norm_w: off only where a file's
    # expert_weights_norm says so, and in the negative controls)
    normalize: bool = True
    # the router's bias, float32 (n_experts,): gpt-oss
    router_bias: torch.Tensor | None = None
    # "softmax" (over all experts, then the top k), "topk_softmax" (the top k logits, then
    # a softmax over them: gpt-oss) or "sigmoid" (each expert's own: GLM-4.5, DeepSeek-V3)
    gating: str = "softmax"
    # added to the gated probabilities to choose the top k, not to weigh them, float32
    # (n_experts,): llama.cpp's exp_probs_b, transformers' e_score_correction_bias
    selection_bias: torch.Tensor | None = None
    # grouped choice (select_groups): the experts in `groups` groups, the best `groups_used`
    # of them kept (0 or 1 group: none)
    groups: int = 0
    groups_used: int = 0
    # the routed weights' factor, after renormalising (routed_scaling_factor: GLM-4.5 2.5)
    scale: float = 1.0
    # the expert every token takes (GLM-4.5, DeepSeek; Gemma 4's dense MLP)
    shared: SharedExpert | None = None
    # Gemma 4's pieces (module doc): the router's input the residual stream's unit RMSNorm
    # over sqrt(hidden) times this, float32 (hidden,) (ffn_gate_inp.scale); each expert's
    # factor on its weight, float32 (n_experts,) (ffn_down_exps.scale, transformers'
    # per_expert_scale); the experts' own input norm from the residual stream (pre_ffw_norm_2)
    # and the norm of their sum (post_ffw_norm_2), (hidden,) each
    router_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None
    expert_norm: torch.Tensor | None = None
    expert_post_norm: torch.Tensor | None = None
    # called with the block's residual stream at "input" (the block's input) and at
    # "attention" (after the attention's residual add): a guess of the next layer's experts
    # from it, whose cold ones it reads ahead (weights.expert_ahead); None: no guess
    ahead: Callable[[torch.Tensor, str], None] | None = None
    # the layer's one-call CPU decode form (model.cpu_native_moe), made at its first CPU
    # decode token: a MoeNativeLayer, or False where the layer cannot take one
    cpu_native: object = None


def gate(logits: torch.Tensor, gating: str) -> torch.Tensor:
    """The router's probabilities (T, n_experts), float32, of its logits: a softmax over the
    experts or each expert's sigmoid."""
    if gating == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if gating == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"unknown gating {gating!r}; expected softmax, sigmoid or topk_softmax")


def select_groups(scores: torch.Tensor, groups: int, groups_used: int) -> torch.Tensor:
    """scores (T, n_experts) with the experts outside each row's `groups_used` best groups set
    to -inf: the experts split into `groups` equal groups in order, a group scored by the sum
    of its two highest scores (llama.cpp's build_moe_ffn; DeepSeek-V3's noaux_tc)."""
    T, n = scores.shape
    if groups <= 1:
        return scores
    if n % groups or not 0 < groups_used <= groups:
        raise ValueError(f"{n} experts in {groups} groups, {groups_used} of them used: the "
                         f"experts must split evenly and at least one group be used")
    grouped = scores.view(T, groups, n // groups)
    group_scores = grouped.topk(min(2, n // groups), dim=-1).values.sum(dim=-1)  # (T, groups)
    keep = group_scores.topk(groups_used, dim=-1).indices
    mask = torch.zeros(T, groups, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, keep, True)
    return grouped.masked_fill(~mask[..., None], float("-inf")).view(T, n)


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool = True,
          bias: torch.Tensor | None = None, gating: str = "softmax",
          selection_bias: torch.Tensor | None = None, groups: int = 0, groups_used: int = 0,
          scale: float = 1.0, expert_scale: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids), each (T, top_k): the experts each row of h (T, hidden) goes to, by
    descending choice score, and their weights (float32), each times its expert's
    `expert_scale` where given (Gemma 4)."""
    weights, ids = _route(h, router, top_k, normalize, bias, gating, selection_bias, groups,
                          groups_used, scale)
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    return weights, ids


def _route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool,
           bias: torch.Tensor | None, gating: str, selection_bias: torch.Tensor | None,
           groups: int, groups_used: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h.to(router.dtype), router, bias)
    if gating == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = gate(logits, gating)
    choice = probs if selection_bias is None else probs + selection_bias
    choice = select_groups(choice, groups, groups_used)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids


def router_input(x: torch.Tensor, scale: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Gemma 4's router input: x's RMSNorm without weight, over sqrt(hidden), times `scale`
    (llama.cpp's gemma4 graph; transformers' Gemma4TextRouter), float32."""
    return norm(x.float(), None) * (x.shape[-1] ** -0.5) * scale


def moe_ffn(h: torch.Tensor, moe: MoeWeights, x: torch.Tensor | None = None,
            norm: Norm | None = None) -> torch.Tensor:
    """The FFN output (T, hidden), float32, of the normed hidden states h (T, hidden). `x`:
    the un-normed residual stream and `norm` the block's RMSNorm, which Gemma 4's pieces read
    (router_scale, expert_norm, expert_post_norm, the shared expert's post-norm)."""
    if (moe.router_scale is not None or moe.expert_norm is not None) and x is None:
        raise ValueError("this mixture of experts routes from the residual stream: pass x")
    needs_norm = (moe.router_scale, moe.expert_norm, moe.expert_post_norm,
                  moe.shared.post_norm if moe.shared is not None else None)
    if norm is None and any(t is not None for t in needs_norm):
        raise ValueError("this mixture of experts has norms of its own: pass the block's norm")
    r = h if moe.router_scale is None else router_input(x, moe.router_scale, norm)
    weights, ids = route(r, moe.router, moe.top_k, moe.normalize, moe.router_bias, moe.gating,
                         moe.selection_bias, moe.groups, moe.groups_used, moe.scale,
                         moe.expert_scale)
    e = h if moe.expert_norm is None else norm(x, moe.expert_norm)
    out = moe.experts.mix(e, ids, weights)
    if moe.expert_post_norm is not None:
        out = norm(out, moe.expert_post_norm).float()
    if moe.shared is not None:
        out += moe.shared(h, norm).float()
    return out


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
