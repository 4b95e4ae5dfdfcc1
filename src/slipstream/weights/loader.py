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
from .linear import DenseLinear, QuantEmbedding, QuantLinear, Workspace


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

    quantized = device.type == "cuda"
    workspace = Workspace(device) if quantized else None

    def bias_of(prefix: str, rows: int) -> torch.Tensor | None:
        name = f"{prefix}.bias"
        if name not in gf.tensors:
            return None
        tick(name)
        return dense(gf, name, (rows,), torch.float32, device)

    def linears(prefixes: list[str], shape_of: dict) -> tuple[Callable | None, list[Callable]]:
        """The layers for `prefixes` (same input), plus one fused layer over all of them when
        their formats allow it (None otherwise)."""
        shapes_ = [shape_of[f"{p.rsplit('.', 1)[1]}.weight"] for p in prefixes]
        biases = [bias_of(p, s[0]) for p, s in zip(prefixes, shapes_)]
        if not quantized:
            parts = []
            for p, s, b in zip(prefixes, shapes_, biases):
                parts.append(DenseLinear(dense(gf, f"{p}.weight", s, weight_dtype, device), b))
                tick(f"{p}.weight")
            if len(parts) == 1:
                return None, parts
            return DenseLinear.fuse(parts)
        # GPU: the weights stay quantized, repacked for the kernels. Rows of the same format
        # concatenate into one packed weight, so q/k/v (gate/up) cost one kernel launch.
        from .. import kernels

        types = {gf.tensors[f"{p}.weight"].ggml_type for p in prefixes}
        raws = [raw_tensor(gf, f"{p}.weight", s).to(device) for p, s in zip(prefixes, shapes_)]
        for p in prefixes:
            tick(f"{p}.weight")
        if len(prefixes) > 1 and len(types) == 1:
            rows = sum(s[0] for s in shapes_)
            packed = kernels.pack_weight(torch.cat(raws), types.pop(), rows, shapes_[0][1])
            bias = (torch.cat([b if b is not None else torch.zeros(s[0], device=device)
                               for b, s in zip(biases, shapes_)])
                    if any(b is not None for b in biases) else None)
            return QuantLinear(packed, bias, workspace), []
        parts = [QuantLinear(kernels.pack_weight(r, gf.tensors[f"{p}.weight"].ggml_type, *s), b,
                             workspace) for p, r, s, b in zip(prefixes, raws, shapes_, biases)]
        return None, parts

    shapes = expected_shapes(cfg)
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        qkv, qkv_parts = linears([f"{p}.attn_q", f"{p}.attn_k", f"{p}.attn_v"], shapes)
        gate_up, gu_parts = linears([f"{p}.ffn_gate", f"{p}.ffn_up"], shapes)
        (_, (attn_output,)), (_, (ffn_down,)) = (linears([f"{p}.attn_output"], shapes),
                                                 linears([f"{p}.ffn_down"], shapes))
        q, k, v = qkv_parts if qkv_parts else (None, None, None)
        gate, up = gu_parts if gu_parts else (None, None)
        layers.append(LayerWeights(attn_norm=norm(f"{p}.attn_norm.weight"),
                                   ffn_norm=norm(f"{p}.ffn_norm.weight"), attn_q=q, attn_k=k,
                                   attn_v=v, attn_output=attn_output, ffn_gate=gate, ffn_up=up,
                                   ffn_down=ffn_down, attn_qkv=qkv, ffn_gate_up=gate_up))

    embed_shape = (cfg.vocab_size, cfg.hidden)
    embed_info = gf.tensors.get("token_embd.weight")
    embed_raw = raw_tensor(gf, "token_embd.weight", embed_shape).to(device)
    embed = QuantEmbedding(embed_raw, embed_info.ggml_type, cfg.hidden, act_dtype)
    tick("token_embd.weight")
    # Tied embeddings: models without output.weight reuse the embedding matrix as the head.
    head_name = "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"
    if quantized:
        from .. import kernels

        head_raw = raw_tensor(gf, head_name, embed_shape).to(device)
        output = QuantLinear(kernels.pack_weight(head_raw, gf.tensors[head_name].ggml_type,
                                                 *embed_shape), None, workspace)
    else:
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
