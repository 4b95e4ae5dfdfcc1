"""The layer pieces GLM-4.5 and DeepSeek share around their experts, as llama.cpp's
glm4-moe and deepseek2 graphs read them:
- the first `leading_dense_block_count` layers have a dense SwiGLU FFN (`feed_forward_length`
  wide), the others a mixture of experts (`expert_feed_forward_length` wide each);
- each mixture has `expert_shared_count` shared experts, stored as one SwiGLU FFN
  `expert_shared_count * expert_feed_forward_length` wide (ffn_*_shexp) that every token
  takes (model.moe.SharedExpert);
- the routing: `expert_gating_func` (1 softmax, 2 sigmoid), a selection bias
  (`exp_probs_b.bias`, DeepSeek-V3 and GLM-4.5), groups (`expert_group_count`,
  `expert_group_used_count`), renormalised weights (`expert_weights_norm`) and their
  factor (`expert_weights_scale`);
- `nextn_predict_layers` multi-token-prediction layers after the model's own, which the
  model does not run (llama.cpp skips them too).

Shapes, torch order:
- ffn_gate_shexp.weight, ffn_up_shexp.weight (shared_ffn, hidden); ffn_down_shexp.weight
  (hidden, shared_ffn);
- exp_probs_b.bias (n_experts,) (the selection bias: SELECTION_BIAS)."""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import InvalidMetadata, MissingMetadata
from ...modelfile.hparams import FIX, md_bool, md_float, md_int
from ..layer_spec import LinearGroup, TensorSpec
from .experts import EXPERT_TENSORS, EXPERTS

MAX_EXPERT_FFN = 1 << 20
# GGUF's expert_gating_func (gguf-py's ExpertGatingFuncType)
GATING = {1: "softmax", 2: "sigmoid"}


def shared_ffn(c: Any) -> int:
    return c.shexp_ffn or c.n_shared_experts * c.expert_ffn


# the dense FFN of the leading layers (held where the layer's config has no experts)
DENSE_FFN: tuple[TensorSpec, ...] = (
    TensorSpec("ffn_gate.weight", "weight", lambda c: (c.ffn, c.hidden), when="dense_ffn"),
    TensorSpec("ffn_up.weight", "weight", lambda c: (c.ffn, c.hidden), when="dense_ffn"),
    TensorSpec("ffn_down.weight", "weight", lambda c: (c.hidden, c.ffn), when="dense_ffn"),
)

# the selection bias, required (GLM-4.5) or read where the file has it (DeepSeek: V3's files
# have it, V2's not), as llama.cpp reads each
SELECTION_BIAS = TensorSpec(f"{EXPERTS.selection_bias}.bias", "bias", lambda c: (c.n_experts,),
                            when="n_experts")
OPTIONAL_SELECTION_BIAS = TensorSpec(SELECTION_BIAS.suffix, "bias", SELECTION_BIAS.shape,
                                     flag="selection_bias", when="n_experts")
# the experts and the shared expert (held by the layers past the dense ones)
ROUTED: tuple[TensorSpec, ...] = (
    *(TensorSpec(t.suffix, t.kind, t.shape, when=t.when or "n_experts")
      for t in EXPERT_TENSORS),
    TensorSpec("ffn_gate_shexp.weight", "weight", lambda c: (shared_ffn(c), c.hidden),
               when="n_shared_experts"),
    TensorSpec("ffn_up_shexp.weight", "weight", lambda c: (shared_ffn(c), c.hidden),
               when="n_shared_experts"),
    TensorSpec("ffn_down_shexp.weight", "weight", lambda c: (c.hidden, shared_ffn(c)),
               when="n_shared_experts"),
)

FFN_LINEARS: tuple[LinearGroup, ...] = (
    LinearGroup("ffn_gate_up", ("ffn_gate", "ffn_up")),
    LinearGroup("ffn_down", ("ffn_down",)),
    LinearGroup(EXPERTS.shared_gate_up, ("ffn_gate_shexp", "ffn_up_shexp")),
    LinearGroup(EXPERTS.shared_down, ("ffn_down_shexp",)),
)


def routed_fields(md: Mapping[str, Any], arch: str, source: str, base: Mapping[str, Any],
                  gating: str) -> dict[str, Any]:
    """The ModelConfig fields of the pieces above, as llama.cpp reads them: the expert count
    and width and the shared experts' count required, the rest optional with llama.cpp's
    defaults (no dense layer, no groups, weights not renormalised, factor 1, `gating` where
    the file names none). The layer count less the multi-token-prediction layers."""
    key = f"{arch}.expert_count"
    if not base.get("n_experts"):
        raise MissingMetadata(f"{source}: missing required metadata '{key}' (a {arch} model's "
                              f"layers past the leading dense ones are mixtures of experts)")
    n, n_layers = base["n_experts"], base["n_layers"]
    width = md_int(md, f"{arch}.expert_feed_forward_length", source, 1, MAX_EXPERT_FFN)
    func = md_int(md, f"{arch}.expert_gating_func", source, 0, 1 << 16, default=0)
    if func and func not in GATING:
        raise InvalidMetadata(f"{source}: metadata '{arch}.expert_gating_func' is {func}; "
                              f"slipstream runs 1 (softmax) and 2 (sigmoid)")
    nextn = md_int(md, f"{arch}.nextn_predict_layers", source, 0, n_layers - 1, default=0,
                   hint=f" (fewer than the {n_layers} layers)")
    lead = md_int(md, f"{arch}.leading_dense_block_count", source, 0, n_layers - nextn,
                  default=0)
    groups = md_int(md, f"{arch}.expert_group_count", source, 0, n, default=0)
    used = 0
    if groups > 1:
        used = md_int(md, f"{arch}.expert_group_used_count", source, 1, groups)
        if n % groups:
            raise InvalidMetadata(f"{source}: metadata '{arch}.expert_group_count' is {groups}, "
                                  f"which does not divide the {n} experts; {FIX}")
        if used * n // groups < base["n_experts_used"]:
            raise InvalidMetadata(
                f"{source}: {used} groups of {n // groups} experts cannot hold the "
                f"{base['n_experts_used']} experts a token uses "
                f"('{arch}.expert_group_used_count'); {FIX}")
    return dict(
        n_layers=n_layers - nextn, nextn_layers=nextn, dense_lead=lead, expert_ffn=width,
        n_shared_experts=md_int(md, f"{arch}.expert_shared_count", source, 0, 1 << 10),
        moe_gating=GATING.get(func, gating),
        moe_norm=md_bool(md, f"{arch}.expert_weights_norm", source, False),
        moe_scale=md_float(md, f"{arch}.expert_weights_scale", source, 1.0, 0.0, 1e6) or 1.0,
        expert_groups=groups if groups > 1 else 0, expert_groups_used=used)
