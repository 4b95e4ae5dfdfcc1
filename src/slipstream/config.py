"""ModelConfig: the shape and hyper-parameters of a model, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from .errors import GGUFError, MissingMetadata, UnsupportedArchitecture

# Architectures with the Llama block shape. The value says how RoPE pairs dimensions:
# llama.cpp's converter permutes Llama's Q/K rows so that adjacent dims form a rotation pair
# ("normal" RoPE), while Qwen2 is stored unpermuted and pairs dim i with dim i + d/2 ("neox").
ARCHITECTURES: dict[str, str] = {
    "llama": "normal",
    "mistral": "normal",
    "qwen2": "neox",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_style: str  # "normal" (adjacent pairs) or "neox" (halves)
    rope_scaling: str = "none"  # "none" or "linear"
    rope_scale: float = 1.0  # linear scaling factor (positions divided by it)
    attn_bias: bool = False  # QKV bias (Qwen2)
    name: str = ""

    @property
    def gqa_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tensor_names: set[str] | None = None,
                      source: str = "model") -> "ModelConfig":
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise MissingMetadata(f"{source}: missing required metadata 'general.architecture'")
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{source}: architecture {arch!r} is not supported; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}")

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in md:
                raise MissingMetadata(f"{source}: missing required metadata {full!r}")
            return md[full]

        n_layers = int(need("block_count"))
        hidden = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        n_kv_heads = int(md.get(f"{arch}.attention.head_count_kv", n_heads))
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise GGUFError(f"{source}: head counts {n_heads} (query) and {n_kv_heads} (key/value) "
                            f"are invalid; the query count must be a positive multiple")
        head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
        vocab = md.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = md.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise MissingMetadata(f"{source}: missing required metadata '{arch}.vocab_size' "
                                      f"(and no tokenizer.ggml.tokens to infer it from)")
            vocab = len(tokens)
        scaling = str(md.get(f"{arch}.rope.scaling.type", "none"))
        scale = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ("none", "linear") and not (scaling == "yarn" and scale == 1.0):
            raise UnsupportedArchitecture(f"{source}: RoPE scaling type {scaling!r} is not "
                                          f"supported; supported: none, linear, llama3 (rope_freqs)")
        names = tensor_names or set()
        return cls(
            architecture=arch,
            n_layers=n_layers,
            hidden=hidden,
            ffn=int(need("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            rope_dim=int(md.get(f"{arch}.rope.dimension_count", head_dim)),
            vocab_size=int(vocab),
            context_length=int(md.get(f"{arch}.context_length", 2048)),
            norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_style=ARCHITECTURES[arch],
            rope_scaling="linear" if scaling == "linear" else "none",
            rope_scale=scale if scaling == "linear" else 1.0,
            attn_bias="blk.0.attn_q.bias" in names,
            name=str(md.get("general.name", "")),
        )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
