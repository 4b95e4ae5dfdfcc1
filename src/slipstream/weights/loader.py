"""Build a model's weight objects from a GGUF file for one device."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import quant
from ..config import ModelConfig
from ..errors import GGUFError
from ..gguf_file import GGUFFile
from ..model.llama import LayerWeights
from .linear import DenseLinear, QuantEmbedding


@dataclass
class ModelWeights:
    embed: QuantEmbedding
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # (hidden,)
    output: Callable[[torch.Tensor], torch.Tensor]  # hidden -> vocab
    rope_freqs: torch.Tensor | None  # (rope_dim/2,) llama3 frequency divisors, or None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes of each per-layer tensor (with the `blk.N.` prefix removed)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_dim
    shapes = {
        "attn_norm.weight": (cfg.hidden,),
        "attn_q.weight": (q_dim, cfg.hidden),
        "attn_k.weight": (kv_dim, cfg.hidden),
        "attn_v.weight": (kv_dim, cfg.hidden),
        "attn_output.weight": (cfg.hidden, q_dim),
        "ffn_norm.weight": (cfg.hidden,),
        "ffn_gate.weight": (cfg.ffn, cfg.hidden),
        "ffn_up.weight": (cfg.ffn, cfg.hidden),
        "ffn_down.weight": (cfg.hidden, cfg.ffn),
    }
    if cfg.attn_bias:
        shapes.update({"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,),
                       "attn_v.bias": (kv_dim,)})
    return shapes


def raw_tensor(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's bytes as a uint8 torch tensor (rows, row_bytes), after checking its shape."""
    info = gf.tensors.get(name)
    if info is None:
        raise GGUFError(f"{gf.path.name}: missing tensor {name!r}")
    if tuple(info.shape) != tuple(shape):
        raise GGUFError(f"{gf.path.name}: tensor {name!r} has shape {list(info.shape)}, "
                        f"expected {list(shape)} from the model metadata")
    data = gf.tensor_bytes(name)
    with warnings.catch_warnings():
        # The memory map is read-only and torch warns about that; we never write through it.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.asarray(data))
    rows = shape[0] if len(shape) == 2 else 1
    return t.view(rows, -1)


def dense(gf: GGUFFile, name: str, shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    info = gf.tensors.get(name)
    raw = raw_tensor(gf, name, shape)
    return quant.dequantize(raw, info.ggml_type, shape).to(device=device, dtype=dtype)


def load_weights(gf: GGUFFile, cfg: ModelConfig, device: torch.device,
                 weight_dtype: torch.dtype, act_dtype: torch.dtype,
                 progress: Callable[[int], None] | None = None) -> ModelWeights:
    """Dequantize every 2-D weight into `weight_dtype` on `device`; norms stay float32.

    `progress(n_bytes)` is called after each tensor so callers can drive a progress bar.
    """
    for name, info in gf.tensors.items():
        quant.get_format(info.ggml_type)  # unsupported types fail here, naming the type

    def tick(name: str) -> None:
        if progress is not None and name in gf.tensors:
            progress(gf.tensors[name].n_bytes)

    def norm(name: str) -> torch.Tensor:
        t = dense(gf, name, (cfg.hidden,), torch.float32, device)
        tick(name)
        return t

    def linear(prefix: str, shape: tuple[int, ...], shapes: dict) -> DenseLinear:
        w = dense(gf, f"{prefix}.weight", shape, weight_dtype, device)
        tick(f"{prefix}.weight")
        bias = None
        bias_name = f"{prefix}.bias"
        if bias_name in gf.tensors:
            bias = dense(gf, bias_name, (shape[0],), torch.float32, device)
            tick(bias_name)
        return DenseLinear(w, bias)

    shapes = expected_shapes(cfg)
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        lin = {k: linear(f"{p}.{k}", shapes[f"{k}.weight"], shapes)
               for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                         "ffn_down")}
        qkv, (lin["attn_q"], lin["attn_k"], lin["attn_v"]) = DenseLinear.fuse(
            [lin["attn_q"], lin["attn_k"], lin["attn_v"]])
        gate_up, (lin["ffn_gate"], lin["ffn_up"]) = DenseLinear.fuse(
            [lin["ffn_gate"], lin["ffn_up"]])
        layers.append(LayerWeights(attn_norm=norm(f"{p}.attn_norm.weight"),
                                   ffn_norm=norm(f"{p}.ffn_norm.weight"), attn_qkv=qkv,
                                   ffn_gate_up=gate_up, **lin))

    embed_shape = (cfg.vocab_size, cfg.hidden)
    embed_info = gf.tensors.get("token_embd.weight")
    embed_raw = raw_tensor(gf, "token_embd.weight", embed_shape).to(device)
    embed = QuantEmbedding(embed_raw, embed_info.ggml_type, cfg.hidden, act_dtype)
    tick("token_embd.weight")
    # Tied embeddings: models without output.weight reuse the embedding matrix as the head.
    head_name = "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"
    output = DenseLinear(dense(gf, head_name, embed_shape, weight_dtype, device))
    if head_name == "output.weight":
        tick(head_name)
    rope_freqs = None
    if "rope_freqs.weight" in gf.tensors:
        rope_freqs = dense(gf, "rope_freqs.weight", (cfg.rope_dim // 2,), torch.float32,
                           torch.device("cpu"))
    return ModelWeights(embed=embed, layers=layers,
                        output_norm=norm("output_norm.weight"), output=output,
                        rope_freqs=rope_freqs)
