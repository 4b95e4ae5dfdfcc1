"""What a decoder layer is made of, said once: its tensors (GGUF names without the `blk.N.`
prefix, torch-order shapes from the ModelConfig), which of its linears read the same input and
are built as one, its norms; plus the names around the layers (token embedding, head) and the
KV cache's size. The loader builds layers by it, memory.vram and memory.setup size them by it,
and synth.py writes files by it, so none of them can disagree with another about a layer.

Keyed by architecture family, as gguf-py's MODEL_TENSORS is keyed by architecture: every
architecture of ARCHITECTURES (Llama 1/2/3, Mistral, SmolLM, Qwen2) has the Llama block, Qwen2's
QKV biases being optional tensors of it. modelfile.config reads this table (which architectures
exist, how they pair RoPE dimensions, which tensors a file must hold) and imports nothing from
here back: this module only names ModelConfig in its type hints.

Pure data and small functions over a ModelConfig and a file's tensor names or types: nothing
here reads tensor bytes or touches a device, nor imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable

from ..errors import UnsupportedArchitecture

if TYPE_CHECKING:  # type hints only: modelfile.config imports this module
    from ..modelfile.config import ModelConfig

Shape = tuple[int, ...]

# Architectures with the Llama block shape. The value says how RoPE pairs dimensions:
# llama.cpp's converter permutes Llama's Q/K rows so that adjacent dims form a rotation pair
# ("normal" RoPE), while Qwen2 is stored unpermuted and pairs dim i with dim i + d/2 ("neox").
ARCHITECTURES: dict[str, str] = {
    "llama": "normal",
    "mistral": "normal",
    "qwen2": "neox",
}

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

    @property
    def optional(self) -> bool:
        return self.flag is not None

    def expected(self, cfg: ModelConfig) -> bool:
        """Whether a layer of `cfg` is expected to have this tensor."""
        return self.flag is None or bool(getattr(cfg, self.flag))


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
class LayerSpec:
    """One architecture family's decoder layer."""

    tensors: tuple[TensorSpec, ...]
    norms: tuple[str, ...]  # LayerWeights fields of the norm weights (tensors f"{norm}.weight")
    linears: tuple[LinearGroup, ...]  # in the order LayerBuilder builds them

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


def _q_dim(cfg: ModelConfig) -> int:
    return cfg.n_heads * cfg.head_dim


# The Llama block: RMSNorm, attention (q/k/v with optional biases, grouped KV heads), RMSNorm,
# SwiGLU. The tensors are listed norm, attention, norm, FFN, then the optional biases: the
# order check_layer_shapes reports problems in.
LLAMA = LayerSpec(
    tensors=(
        TensorSpec("attn_norm.weight", "norm", lambda c: (c.hidden,)),
        TensorSpec("attn_q.weight", "weight", lambda c: (_q_dim(c), c.hidden)),
        TensorSpec("attn_k.weight", "weight", lambda c: (c.kv_dim, c.hidden)),
        TensorSpec("attn_v.weight", "weight", lambda c: (c.kv_dim, c.hidden)),
        TensorSpec("attn_output.weight", "weight", lambda c: (c.hidden, _q_dim(c))),
        TensorSpec("ffn_norm.weight", "norm", lambda c: (c.hidden,)),
        TensorSpec("ffn_gate.weight", "weight", lambda c: (c.ffn, c.hidden)),
        TensorSpec("ffn_up.weight", "weight", lambda c: (c.ffn, c.hidden)),
        TensorSpec("ffn_down.weight", "weight", lambda c: (c.hidden, c.ffn)),
        TensorSpec("attn_q.bias", "bias", lambda c: (_q_dim(c),), flag="attn_bias"),
        TensorSpec("attn_k.bias", "bias", lambda c: (c.kv_dim,), flag="attn_bias"),
        TensorSpec("attn_v.bias", "bias", lambda c: (c.kv_dim,), flag="attn_bias"),
    ),
    norms=("attn_norm", "ffn_norm"),
    linears=(
        LinearGroup("attn_qkv", ("attn_q", "attn_k", "attn_v")),
        LinearGroup("ffn_gate_up", ("ffn_gate", "ffn_up")),
        LinearGroup("attn_output", ("attn_output",)),
        LinearGroup("ffn_down", ("ffn_down",)),
    ),
)

FAMILIES: dict[str, LayerSpec] = {"llama": LLAMA}
# every architecture of ARCHITECTURES has the Llama block
FAMILY_OF: dict[str, str] = {arch: "llama" for arch in ARCHITECTURES}


def spec_for(architecture: str) -> LayerSpec:
    """The layer of `architecture` (general.architecture, as in ModelConfig.architecture)."""
    family = FAMILY_OF.get(architecture)
    if family is None:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(FAMILY_OF))}")
    return FAMILIES[family]


def head_tensor_name(names: Collection[str]) -> str:
    """The head's tensor in a file with tensors `names`: models without output.weight (tied
    embeddings) reuse the embedding matrix as the head."""
    return HEAD if HEAD in names else EMBEDDING


def kv_cache_bytes(cfg: ModelConfig, n_layers: int, ctx: int, bytes_per_elem: int) -> int:
    """Bytes of the keys and values of `n_layers` layers for `ctx` positions (runtime.kv_cache
    allocates (n_layers, n_kv_heads, ctx, head_dim) of each)."""
    return 2 * n_layers * cfg.n_kv_heads * ctx * cfg.head_dim * bytes_per_elem
