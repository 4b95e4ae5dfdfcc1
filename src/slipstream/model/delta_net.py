"""Gated DeltaNet linear attention (Qwen3.5's linear-attention layers), as llama.cpp's
qwen35 graph (build_layer_attn_linear, delta-net-base.cpp) and transformers'
Qwen3_5GatedDeltaNet compute it. For the normed hidden states h (T, hidden):

    mixed    = attn_qkv(h)                         (T, conv_dim): queries, keys, values
    mixed    = silu(causal depthwise conv(mixed))  kernel taps per channel, over the last
                                                   kernel - 1 inputs kept in the conv state
    q, k     = l2norm per head (groups heads, state wide); v (heads heads, state wide)
    beta     = sigmoid(ssm_beta(h)), g = softplus(ssm_alpha(h) + dt_bias) * ssm_a   (T, heads)
    per token, per value head (its key head: h mod groups, the converter's tiled order):
        S = exp(g) S                       decay (ssm_a = -exp(A_log) < 0)
        S = S + beta (v - S k) k^T         the delta rule's write
        o = S q / sqrt(state)
    out      = ssm_out(rms_norm(o, ssm_norm) * silu(z)),  z = attn_gate(h)

S is (value width, key width) per head, float32, carried across passes in the layer's
recurrent state; the conv state holds the last kernel - 1 inputs (channels, kernel - 1), as
llama.cpp's r state does. A decode token steps the recurrence (the definition); a pass of
more tokens runs it by chunks as matmuls (delta_rule_chunked), the same sums reassociated:
a 512-token prompt over 32 heads of 128 took 0.37 s against 1.67 s stepped (one thread)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from ..errors import RecurrentState

if TYPE_CHECKING:  # type hints only: model.llama imports this module
    from ..modelfile.config import ModelConfig
    from .llama import LayerWeights
    from .step import Step

# Passes of more than one token run the recurrence by chunks of CHUNK tokens
# (delta_rule_chunked; delta_rule_steps is the definition the tests compare it with)
CHUNK = 64


def delta_net(cfg: ModelConfig, w: LayerWeights, h: torch.Tensor, step: Step,
              conv_state: torch.Tensor, state: torch.Tensor,
              rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
              ) -> torch.Tensor:
    """The linear-attention output (T, hidden) of the normed hidden states h (T, hidden) of
    tokens appended right after the context the states hold. conv_state (conv_dim,
    kernel - 1) and state (heads, state, state), float32, are updated in place. `rms_norm`:
    the block's (model.llama, which imports this module)."""
    if not step.causal or step.start is None:
        raise RecurrentState(
            f"a {cfg.architecture} linear-attention layer folds the context into one state, "
            f"so it runs only tokens appended in order, not a step at chosen positions (a "
            f"speculative tree)")
    T, H, S, G = h.shape[0], cfg.ssm_heads, cfg.ssm_state, cfg.ssm_groups
    mixed = w.attn_qkv(h).float()  # (T, conv_dim)
    z = w.attn_gate(h).float().view(T, H, S)
    beta = torch.sigmoid(w.ssm_beta(h).float())  # (T, H)
    g = F.softplus(w.ssm_alpha(h).float() + w.ssm_dt) * w.ssm_a  # (T, H)
    qkv = F.silu(causal_conv(mixed, conv_state, w.ssm_conv1d))
    key = G * S
    q = l2_normed(qkv[:, :key].reshape(T, G, S), cfg.norm_eps)
    k = l2_normed(qkv[:, key:2 * key].reshape(T, G, S), cfg.norm_eps)
    v = qkv[:, 2 * key:].reshape(T, H, S)
    tiles = key_heads(H, G, h.device)
    q, k = q[:, tiles] / math.sqrt(S), k[:, tiles]
    o = delta_rule(q, k, v, g, beta, state)  # (T, H, S)
    o = rms_norm(o, w.ssm_norm, cfg.norm_eps) * F.silu(z)
    return w.ssm_out(o.reshape(T, H * S).to(h.dtype))


def key_heads(heads: int, groups: int, device: torch.device) -> torch.Tensor:
    """Each value head's key head, (heads,): h mod groups, the tiled order llama.cpp's
    converter writes the value heads in (ggml's broadcast repeats the key heads whole;
    transformers' checkpoint order, grouped, would be h // (heads / groups))."""
    return torch.arange(heads, device=device) % groups


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                ) -> torch.Tensor:
    """The depthwise causal conv of x (T, C) over the kept inputs conv_state (C, K - 1) and
    x: out[t, c] = sum_j weight[c, j] * in[c, t + j], in = [conv_state | x^T] (as
    ggml_ssm_conv); conv_state then holds the last K - 1 inputs. Returns (T, C) float32."""
    T, K = x.shape[0], weight.shape[1]
    window = torch.cat((conv_state, x.t()), dim=1)  # (C, K - 1 + T)
    out = (window.unfold(1, K, 1) * weight[:, None, :]).sum(-1)  # (C, T)
    conv_state.copy_(window[:, T:])
    return out.t()


def l2_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its last dimension's L2 norm, x / sqrt(sum x^2 + eps): llama.cpp's
    build_gdn_l2_norm (rms_norm with eps / n, times 1 / sqrt(n)); transformers' l2norm."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over T tokens: q, k, v (T, H, S) (q already scaled), g and beta
    (T, H); state (H, S_v, S_k) float32, updated in place. Returns o (T, H, S_v) float32.
    One token (decode) steps; more go by chunks (delta_rule_chunked)."""
    if q.shape[0] > 1:
        return delta_rule_chunked(q, k, v, g, beta, state)
    return delta_rule_steps(q, k, v, g, beta, state)


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """delta_rule token by token: the definition, and one decode token's path (in place: a
    copy of Qwen3.5-35B-A3B's 2 MiB state per layer would be 120 MB moved per token)."""
    s = state
    out = torch.empty_like(v)
    decay = torch.exp(g)
    for t in range(q.shape[0]):
        s.mul_(decay[t, :, None, None])
        sk = torch.einsum("hji,hi->hj", s, k[t])
        d = (v[t] - sk) * beta[t, :, None]
        s.baddbmm_(d[:, :, None], k[t][:, None, :])  # S += d k^T, no (H, S, S) temporary
        out[t] = torch.einsum("hji,hi->hj", s, q[t])
    return out


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """delta_rule by chunks of `chunk` tokens (default CHUNK, or T where fewer), the same sums
    as matmuls (the WY form llama.cpp's build_delta_net_chunking and transformers'
    torch_chunk_gated_delta_rule use). Within a chunk, with G the decays' running sum and
    D[i, j] = exp(G_i - G_j) for j <= i:
        A = (I + strictly_lower(diag(beta) K K^T * D))^-1       a triangular solve
        U = A (beta V),  W = A (beta exp(G) K)                  the writes, state-free
        V' = U - W S^T                                          what the state leaves
        O = exp(G) Q S^T + lower(Q K^T * D) V'
        S = exp(G_last) S + V'^T (exp(G_last - G) K)
    A 2048-token prompt takes 32 chunks of a few matmuls per head instead of 2048 steps over
    the whole state (2 MiB a layer in Qwen3.5-35B-A3B)."""
    T, H, Sk = k.shape
    C = chunk or min(CHUNK, T)
    pad = -T % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:  # (T', H, ...) -> (H, n, C, ...)
        return x.reshape(n, C, H, *x.shape[2:]).transpose(0, 2).transpose(1, 2)

    q, k, v = chunks(q), chunks(k), chunks(v)  # (H, n, C, S)
    g, beta = chunks(g), chunks(beta)  # (H, n, C)
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, 0.0).exp() * lower
    kb = k * beta[..., None]
    L = (kb @ k.transpose(-1, -2) * D).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False)
    U = A @ (v * beta[..., None])
    W = A @ (kb * G.exp()[..., None])
    intra = (q @ k.transpose(-1, -2) * D)  # (D is zero above the diagonal)
    s = state.transpose(1, 2).clone()  # (H, S_k, S_v)
    out = torch.empty_like(v)
    for c in range(n):
        vn = U[:, c] - W[:, c] @ s
        out[:, c] = (q[:, c] * G[:, c, :, None].exp()) @ s + intra[:, c] @ vn
        last = G[:, c, -1]
        s = s * last.exp()[:, None, None] + \
            (k[:, c] * (last[:, None] - G[:, c]).exp()[..., None]).transpose(-1, -2) @ vn
    state.copy_(s.transpose(1, 2))
    return out.transpose(1, 2).transpose(0, 2).reshape(n * C, H, -1)[:T]
