"""The mixture-of-experts FFN as a family's layer states it: the dense SwiGLU FFN's three
matrices replaced by a router and three 3-D expert tensors (model.moe runs them). Qwen3-MoE's
layer is Qwen3's so changed; Mixtral's is Llama's (a `llama` file with `llama.expert_count`).

Shapes, torch order, as llama.cpp creates the tensors (GGUF ne reversed):
- ffn_gate_inp.weight  (n_experts, hidden): the router, one row of logits per expert;
- ffn_gate_exps.weight (n_experts, expert_ffn, hidden) and ffn_up_exps.weight the same, or
  (newer conversions) both in ffn_gate_up_exps.weight (n_experts, 2 * expert_ffn, hidden),
  each expert's gate rows then its up rows;
- ffn_down_exps.weight (n_experts, hidden, expert_ffn).
"""

from __future__ import annotations

from dataclasses import replace

from ..layer_spec import ExpertSpec, LayerSpec, TensorSpec

EXPERTS = ExpertSpec()

EXPERT_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec(f"{EXPERTS.router}.weight", "weight", lambda c: (c.n_experts, c.hidden)),
    # gate and up apart, or in one tensor where the file stores them so
    # (ModelConfig.fused_experts): the layer holds one form or the other
    TensorSpec(f"{EXPERTS.gate}.weight", "weight",
               lambda c: (c.n_experts, c.expert_ffn, c.hidden), when="experts_split"),
    TensorSpec(f"{EXPERTS.up}.weight", "weight",
               lambda c: (c.n_experts, c.expert_ffn, c.hidden), when="experts_split"),
    TensorSpec(f"{EXPERTS.gate_up}.weight", "weight",
               lambda c: (c.n_experts, 2 * c.expert_ffn, c.hidden), when="experts_fused"),
    TensorSpec(f"{EXPERTS.down}.weight", "weight",
               lambda c: (c.n_experts, c.hidden, c.expert_ffn)),
)

# the dense FFN's tensors and linears, which an expert layer has none of
_DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")


def with_experts(layer: LayerSpec) -> LayerSpec:
    """`layer` with its dense FFN (ffn_gate/ffn_up/ffn_down and their fused groups) replaced by
    the experts, placed where the FFN's tensors were (after ffn_norm)."""
    def dense(suffix: str) -> bool:
        return suffix.split(".")[0] in _DENSE_FFN

    tensors: list[TensorSpec] = []
    for t in layer.tensors:
        if dense(t.suffix):
            if not any(e in tensors for e in EXPERT_TENSORS):
                tensors.extend(EXPERT_TENSORS)
            continue
        tensors.append(t)
    linears = tuple(g for g in layer.linears if not any(p in _DENSE_FFN for p in g.parts))
    return replace(layer, tensors=tuple(tensors), linears=linears, experts=EXPERTS)
