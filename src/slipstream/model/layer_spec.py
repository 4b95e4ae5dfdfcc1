"""What a decoder layer is made of, as data: its tensors (GGUF names without the `blk.N.`
prefix, torch-order shapes from the ModelConfig), which of its linears read the same input and
are built as one, its norms; plus the names around the layers (token embedding, head) and the
KV cache's size. Each family (model.families) states its layer in these terms; the loader
builds layers by it, memory.vram and memory.setup size them by it, and synth.py writes files by
it, so none of them can disagree with another about a layer.

Pure data and small functions over a ModelConfig and a file's tensor names or types: nothing
here reads tensor bytes or touches a device, nor imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable

from .ring_size import ring_slots

if TYPE_CHECKING:  # type hints only: modelfile.config imports the families
    from ..modelfile.config import ModelConfig

Shape = tuple[int, ...]

EMBEDDING = "token_embd.weight"  # (vocab, hidden)
HEAD = "output.weight"  # (vocab, hidden); absent in files with tied embeddings


@dataclass(frozen=True)
class TensorSpec:
    """One per-layer tensor."""

    suffix: str  # the GGUF name without `blk.N.`: "attn_q.weight"
    kind: str  # "norm" (a float32 vector), "weight" (a linear's matrix) or "bias" (float32)
    shape: Callable[[ModelConfig], Shape]  # torch order: (out, in) for a matrix
    # The ModelConfig flag of the files that have it ("attn_bias"). Such tensors are optional:
    # checked and read where the file has them, never required.
    flag: str | None = None
    # The attribute of a layer's config (ModelConfig.layer(i)) that says whether that layer
    # holds the tensor at all: Gemma 4's layers that reuse an earlier layer's keys and values
    # have no key or value projections. Where it is false the tensor is neither required nor
    # read, even if the file has it.
    when: str | None = None

    @property
    def optional(self) -> bool:
        return self.flag is not None

    def expected(self, cfg: ModelConfig) -> bool:
        """Whether a layer of `cfg` is expected to have this tensor."""
        return self.flag is None or bool(getattr(cfg, self.flag))

    def held(self, cfg: ModelConfig) -> bool:
        """Whether a layer whose config is `cfg` (ModelConfig.layer(i)) holds this tensor."""
        return self.when is None or bool(getattr(cfg, self.when))


@dataclass(frozen=True)
class LinearGroup:
    """Linears that read the same input. `field` is the LayerWeights field of the one linear
    the group can be built as; a group of one part is that part (its field is its name)."""

    field: str
    parts: tuple[str, ...]  # each part's tensors are f"{part}.weight" and an optional ".bias"

    def fuses(self, types: Iterable[Any], dense: bool = False) -> bool:
        """The fusion rule, given the parts' GGML types: rows concatenate into one weight only
        where the parts share one storage format. Dense (CPU) weights always do, once
        dequantized to the weight dtype; quantized ones (CUDA) when all parts have one type
        (llama.cpp's Q4_K_M keeps attn_v in Q6_K next to Q4_K attn_q/attn_k: three linears)."""
        return len(self.parts) > 1 and (dense or len(set(types)) == 1)


@dataclass(frozen=True)
class ExpertSpec:
    """A mixture-of-experts FFN's tensors (names without `blk.N.` and `.weight`): the router,
    a matrix (n_experts, hidden), and the experts' SwiGLU weights, each stored as one 3-D
    tensor over the experts, torch order (n_experts, out, in) (GGUF's ne (in, out, n_experts),
    as llama.cpp's converter writes them)."""

    router: str = "ffn_gate_inp"
    gate: str = "ffn_gate_exps"
    up: str = "ffn_up_exps"
    down: str = "ffn_down_exps"
    # gate and up in one tensor (n_experts, 2 * expert_ffn, hidden), each expert's gate rows
    # then its up rows, as newer llama.cpp conversions may write them (llama.cpp's
    # create_tensor_gate_up_exps; build_moe_ffn takes the first half as the gate)
    gate_up: str = "ffn_gate_up_exps"
    # the selection bias (model.moe), a (n_experts,) vector `{name}.bias` (GLM-4.5, DeepSeek-V3)
    selection_bias: str = "exp_probs_b"
    # the shared expert's linears (model.moe.SharedExpert; LayerWeights fields)
    shared_gate_up: str = "ffn_gate_up_shexp"
    shared_down: str = "ffn_down_shexp"
    # the shared expert's gate, a (hidden,) row whose sigmoid scales its output (Qwen3.5-MoE)
    shared_gate: str = "ffn_gate_inp_shexp"
    # Gemma 4's pieces (model.moe.MoeWeights), read where the layer's tensors list them: the
    # router's input scale `{router}.scale` and each expert's factor `{down}.scale` (vectors),
    # the experts' input and output norms and the shared expert's (Gemma 4's dense MLP's)
    # output norm (`{name}.weight`, llama.cpp's ffn_pre_norm_2, ffn_post_norm_2 and
    # ffn_post_norm_1)
    expert_norm: str = "pre_ffw_norm_2"
    expert_post_norm: str = "post_ffw_norm_2"
    shared_post_norm: str = "post_ffw_norm_1"

    @property
    def router_scale(self) -> str:
        return f"{self.router}.scale"

    @property
    def expert_scale(self) -> str:
        return f"{self.down}.scale"

    def parts(self, fused: bool) -> tuple[ExpertPart, ExpertPart, ExpertPart]:
        """Where the experts' gate, up and down projections are stored: in three tensors, or
        (`fused`: ModelConfig.fused_experts) gate and up as the halves of gate_up's."""
        if fused:
            return (ExpertPart(self.gate_up, 0, 2), ExpertPart(self.gate_up, 1, 2),
                    ExpertPart(self.down))
        return ExpertPart(self.gate), ExpertPart(self.up), ExpertPart(self.down)


@dataclass(frozen=True)
class ExpertPart:
    """One projection of a layer's experts as stored: the 3-D tensor `blk.N.{tensor}.weight`
    (n_experts, rows, cols), each expert's rows in `halves` equal blocks, the projection the
    `half`-th (0 of 1 where it has the tensor to itself). Each expert's block is one
    contiguous run of whole rows, so it is a slice of the file either way."""

    tensor: str
    half: int = 0
    halves: int = 1

    def rows(self, stored_rows: int) -> int:
        """The projection's rows per expert, of a tensor of `stored_rows` per expert."""
        return stored_rows // self.halves

    def first(self, stored_rows: int) -> int:
        """The projection's first row within each expert's `stored_rows`."""
        return self.half * self.rows(stored_rows)


@dataclass(frozen=True)
class LayerSpec:
    """One architecture family's decoder layer."""

    tensors: tuple[TensorSpec, ...]
    norms: tuple[str, ...]  # LayerWeights fields of the norm weights (tensors f"{norm}.weight")
    linears: tuple[LinearGroup, ...]  # in the order LayerBuilder builds them
    # the layer's FFN is a mixture of experts (LayerWeights.moe) instead of the linears'
    experts: ExpertSpec | None = None
    # float32 tensors read whole whose names do not end in `.weight` (Qwen3.5's `ssm_a`,
    # `ssm_dt.bias`): full suffixes, each read into the LayerWeights field named by its part
    # before the first dot (vector_field)
    vectors: tuple[str, ...] = ()
    # (the attribute of a layer's config, a linear's part, the part read in its place): where
    # the attribute is true the layer has no tensor of its own for that part, and its linear
    # reads the other part's weight again (Gemma 4's values from the key projection, "v_from_k":
    # attn_v read as attn_k, transformers' attention_k_eq_v)
    reads_as: tuple[tuple[str, str, str], ...] = ()

    def at(self, cfg: ModelConfig) -> "LayerSpec":
        """This layer as a layer whose config is `cfg` (ModelConfig.layer(i)) holds it: the
        tensors it lacks (TensorSpec.when) left out, with their norms and linears, its
        experts where it holds no router (a dense layer of GLM-4.5 or DeepSeek), and the parts
        another part's weight stands in for (`reads_as`) renamed in their linears. The spec
        itself where every tensor is held."""
        kept = tuple(t for t in self.tensors if t.held(cfg))
        stand_ins = {part: other for when, part, other in self.reads_as
                     if getattr(cfg, when) and any(t.suffix == f"{other}.weight" for t in kept)}
        if len(kept) == len(self.tensors) and not stand_ins:
            return self
        kept = tuple(t for t in kept if t.suffix.split(".")[0] not in stand_ins)
        names = {t.suffix for t in kept}
        linears = []
        for g in self.linears:
            g = LinearGroup(g.field, tuple(stand_ins.get(p, p) for p in g.parts))
            parts = tuple(p for p in g.parts if f"{p}.weight" in names)
            if parts == g.parts:
                linears.append(g)
            elif parts:  # what is left of a fused group is built part by part
                linears.extend(LinearGroup(p, (p,)) for p in parts)
        experts = self.experts
        if experts is not None and f"{experts.router}.weight" not in names:
            experts = None
        return LayerSpec(kept, tuple(n for n in self.norms if f"{n}.weight" in names),
                         tuple(linears), experts,
                         vectors=tuple(v for v in self.vectors if v in names),
                         reads_as=self.reads_as)

    def shapes(self, cfg: ModelConfig) -> dict[str, Shape]:
        """Torch-order shape of each tensor a layer of `cfg` is expected to have, by suffix."""
        return {t.suffix: t.shape(cfg) for t in self.tensors if t.expected(cfg)}

    def names(self, i: int, present: Collection[str]) -> list[str]:
        """Full names of layer i's tensors that `present` (a file's tensor names) holds."""
        names = (f"blk.{i}.{t.suffix}" for t in self.tensors)
        return [n for n in names if n in present]

    def fused_elements(self, cfg: ModelConfig) -> list[int]:
        """Elements of each group's weight, counted fused (the parts' rows stacked)."""
        shapes = self.shapes(cfg)
        return [sum(shapes[f"{p}.weight"][0] for p in g.parts)
                * shapes[f"{g.parts[0]}.weight"][1] for g in self.linears]


def recurrent_state_elements(cfg: ModelConfig) -> int:
    """Elements of a linear-attention layer's conv state (conv channels x (kernel - 1)) and
    recurrent state (value heads x head width x head width), summed."""
    return cfg.ssm_conv_dim * (cfg.ssm_conv_kernel - 1) + cfg.ssm_heads * cfg.ssm_state ** 2


def vector_field(suffix: str) -> str:
    """The LayerWeights field of a LayerSpec.vectors entry: "ssm_dt.bias" -> "ssm_dt"."""
    return suffix.split(".")[0]


def head_tensor_name(names: Collection[str]) -> str:
    """The head's tensor in a file with tensors `names`: models without output.weight (tied
    embeddings) reuse the embedding matrix as the head."""
    return HEAD if HEAD in names else EMBEDDING


def kv_cache_bytes(cfg: ModelConfig, layers: int | range, ctx: int,
                   bytes_per_elem: int) -> int:
    """Bytes of the keys and values of `layers` (a range of layer indices, or a count of the
    model's layers) for `ctx` positions: what runtime.kv_cache allocates, (n_kv_heads, slots,
    head_dim) of each per layer that computes its own, where slots is the context or a
    sliding-window layer's ring (model.ring_size). Given a count short of the model's, the
    model's own caches are scaled to it. Multi-head latent attention keeps one tensor, the
    keys' latent, out of which it reads its values too. A linear-attention layer (Qwen3.5)
    keeps its conv and recurrent states instead, float32 whatever the context."""
    kv = 1 if cfg.mla else 2

    def layer_bytes(i: int) -> int:
        c = cfg.layer(i)
        if c.kv_reuse:
            return 0
        if c.recurrent:
            return recurrent_state_elements(c) * 4
        return kv * c.n_kv_heads * ring_slots(cfg, i, ctx) * c.head_dim * bytes_per_elem

    if isinstance(layers, range):
        return sum(layer_bytes(i) for i in layers)
    per_model = sum(layer_bytes(i) for i in range(cfg.n_layers))
    return -(-per_model * layers // cfg.n_layers)
