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


def release_transients(device: torch.device) -> None:
    """Give the allocator's cached blocks back to the device after a layer is built: packing
    frees transients of several hundred MiB that the caching allocator would otherwise keep
    reserved next to the next layer's, and the VRAM budget counts reserved memory (on the
    H200, an 8B's load peaked 0.6 GiB of cache above what it held)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prefill_scratch_elements(cfg: ModelConfig) -> int:
    """Elements of the prefill scratch (Workspace.max_elements): the largest weight of a layer,
    with q/k/v and gate/up counted fused as LayerBuilder fuses them where it can. The head is
    multiplied in row chunks of this size."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_dim
    return max((q_dim + 2 * kv_dim) * cfg.hidden, 2 * cfg.ffn * cfg.hidden,
               cfg.hidden * q_dim, cfg.hidden * cfg.ffn)


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


class TensorSource:
    """Where a layer's tensors come from: the memory-mapped file (resident loading), or a
    buffer holding the bytes of a span of the file (streaming from disk)."""

    def __init__(self, gf: GGUFFile, buffer: torch.Tensor | None = None, base: int = 0):
        self.gf = gf
        self.buffer = buffer  # uint8, file bytes [base, base + len)
        self.base = base

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def type_of(self, name: str):
        return self.gf.tensors[name].ggml_type

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self.buffer is None:
            return raw_tensor(self.gf, name, shape)
        info = self.gf.tensors[name]
        start = info.offset - self.base
        rows = shape[0] if len(shape) == 2 else 1
        return self.buffer[start:start + info.n_bytes].view(rows, -1)

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        t = quant.dequantize(self.raw(name, shape), self.type_of(name), shape).to(
            device=device, dtype=dtype)
        if self.buffer is not None and t.untyped_storage().data_ptr() == \
                self.buffer.untyped_storage().data_ptr():
            t = t.clone()  # F32 tensors decode to views; a staging buffer gets reused
        return t


LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                 "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                 "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias")


def layer_span(gf: GGUFFile, i: int) -> tuple[int, int]:
    """[start, end) of the file bytes holding layer i's tensors."""
    infos = [gf.tensors[f"blk.{i}.{n}"] for n in LAYER_TENSORS if f"blk.{i}.{n}" in gf.tensors]
    return min(t.offset for t in infos), max(t.offset + t.n_bytes for t in infos)


class LayerBuilder:
    """Turns a layer's GGUF tensors into the weight objects the model math calls: dense
    float16/float32 linears on CPU, quantized weights repacked for the Triton kernels on CUDA.
    Resident loading and streaming both build layers here, so their numbers are identical."""

    def __init__(self, cfg: ModelConfig, device: torch.device, weight_dtype: torch.dtype,
                 workspace: Workspace | None = None, fuse_scales: bool = True):
        """fuse_scales (precision="fast"): resident layers fold their scales into one plane
        for the decode kernels; streamed layers (False) keep the smaller GGUF layout and give
        the same results (see QuantLinear)."""
        self.cfg = cfg
        self.device = device
        self.weight_dtype = weight_dtype
        self.fuse_scales = fuse_scales
        self.quantized = device.type == "cuda"
        # precision="fast" (float16 weight_dtype) decodes with int8 activations on CUDA
        self.workspace = workspace if workspace is not None else (
            Workspace(device, int8_activations=weight_dtype != torch.float32,
                      max_elements=prefill_scratch_elements(cfg))
            if self.quantized else None)
        self.shapes = expected_shapes(cfg)

    def build(self, src: TensorSource, i: int) -> LayerWeights:
        p = f"blk.{i}"
        qkv, qkv_parts = self._linears(src, [f"{p}.attn_q", f"{p}.attn_k", f"{p}.attn_v"])
        gate_up, gu_parts = self._linears(src, [f"{p}.ffn_gate", f"{p}.ffn_up"])
        (_, (attn_output,)) = self._linears(src, [f"{p}.attn_output"])
        (_, (ffn_down,)) = self._linears(src, [f"{p}.ffn_down"])
        q, k, v = qkv_parts if qkv_parts else (None, None, None)
        gate, up = gu_parts if gu_parts else (None, None)
        hidden = (self.cfg.hidden,)
        return LayerWeights(
            attn_norm=src.dense(f"{p}.attn_norm.weight", hidden, torch.float32, self.device),
            ffn_norm=src.dense(f"{p}.ffn_norm.weight", hidden, torch.float32, self.device),
            attn_q=q, attn_k=k, attn_v=v, attn_output=attn_output, ffn_gate=gate, ffn_up=up,
            ffn_down=ffn_down, attn_qkv=qkv, ffn_gate_up=gate_up)

    def _linears(self, src: TensorSource, prefixes: list[str]
                 ) -> tuple[Callable | None, list[Callable]]:
        """The layers for `prefixes` (same input), plus one fused layer over all of them when
        their formats allow it (None otherwise)."""
        shapes = [self.shapes[f"{p.rsplit('.', 1)[1]}.weight"] for p in prefixes]
        biases = [src.dense(f"{p}.bias", (s[0],), torch.float32, self.device)
                  if src.has(f"{p}.bias") else None for p, s in zip(prefixes, shapes)]
        if not self.quantized:
            parts = [DenseLinear(src.dense(f"{p}.weight", s, self.weight_dtype, self.device), b)
                     for p, s, b in zip(prefixes, shapes, biases)]
            if len(parts) == 1:
                return None, parts
            return DenseLinear.fuse(parts)
        # GPU: the weights stay quantized, repacked for the kernels. Rows of the same format
        # concatenate into one packed weight, so q/k/v (gate/up) cost one kernel launch.
        from .. import kernels

        types = {src.type_of(f"{p}.weight") for p in prefixes}
        raws = [src.raw(f"{p}.weight", s).to(self.device) for p, s in zip(prefixes, shapes)]
        if len(prefixes) > 1 and len(types) == 1:
            rows = sum(s[0] for s in shapes)
            packed = kernels.pack_weight(torch.cat(raws), types.pop(), rows, shapes[0][1])
            bias = (torch.cat([b if b is not None else torch.zeros(s[0], device=self.device)
                               for b, s in zip(biases, shapes)])
                    if any(b is not None for b in biases) else None)
            return QuantLinear(packed, bias, self.workspace, self.fuse_scales), []
        parts = [QuantLinear(kernels.pack_weight(r, src.type_of(f"{p}.weight"), *s), b,
                             self.workspace, self.fuse_scales)
                 for p, r, s, b in zip(prefixes, raws, shapes, biases)]
        return None, parts


def check_layer_shapes(gf: GGUFFile, cfg: ModelConfig) -> None:
    """Every per-layer tensor exists with the shape the metadata implies (before any byte of
    it is read, so a streamed layer cannot fail half-way through a generation)."""
    shapes = expected_shapes(cfg)
    for i in range(cfg.n_layers):
        for suffix, shape in shapes.items():
            name = f"blk.{i}.{suffix}"
            info = gf.tensors.get(name)
            if info is None:
                if suffix.endswith(".bias"):
                    continue
                raise GGUFError(f"{gf.path.name}: missing tensor {name!r}")
            if tuple(info.shape) != tuple(shape):
                raise GGUFError(f"{gf.path.name}: tensor {name!r} has shape {list(info.shape)}, "
                                f"expected {list(shape)} from the model metadata")


def load_weights(gf: GGUFFile, cfg: ModelConfig, device: torch.device,
                 weight_dtype: torch.dtype, act_dtype: torch.dtype,
                 progress: Callable[[int], None] | None = None,
                 resident_layers: set[int] | None = None,
                 embed_on_host: bool = False) -> ModelWeights:
    """Build the model's weights on `device`: every layer, or only `resident_layers` (the
    others are left as None for a streaming store to fill). Norms stay float32.
    `embed_on_host`: the token embedding stays in the file's memory map (see QuantEmbedding).

    `progress(n_bytes)` is called after each layer so callers can drive a progress bar.
    """
    for name, info in gf.tensors.items():
        quant.get_format(info.ggml_type)  # unsupported types fail here, naming the type
    check_layer_shapes(gf, cfg)
    builder = LayerBuilder(cfg, device, weight_dtype)
    workspace = builder.workspace
    quantized = builder.quantized
    src = TensorSource(gf)

    def tick(name: str) -> None:
        if progress is not None and name in gf.tensors:
            progress(gf.tensors[name].n_bytes)

    embed_shape = (cfg.vocab_size, cfg.hidden)
    embed_info = gf.tensors.get("token_embd.weight")
    embed_raw = raw_tensor(gf, "token_embd.weight", embed_shape)
    if not embed_on_host:
        embed_raw = embed_raw.to(device)
    embed = QuantEmbedding(embed_raw, embed_info.ggml_type, cfg.hidden, act_dtype, device)
    tick("token_embd.weight")
    # Tied embeddings: models without output.weight reuse the embedding matrix as the head.
    head_name = "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"
    if quantized:
        from .. import kernels

        head_raw = raw_tensor(gf, head_name, embed_shape).to(device)
        packed = kernels.pack_weight(head_raw, gf.tensors[head_name].ggml_type, *embed_shape)
        del head_raw  # before QuantLinear reserves the prefill workspace
        output = QuantLinear(packed, None, workspace)
        release_transients(device)
    else:
        output = DenseLinear(src.dense(head_name, embed_shape, weight_dtype, device))
    if head_name == "output.weight":
        tick(head_name)
    rope_freqs = None
    if "rope_freqs.weight" in gf.tensors:
        rope_freqs = src.dense("rope_freqs.weight", (cfg.rope_dim // 2,), torch.float32,
                               torch.device("cpu"))
    output_norm = src.dense("output_norm.weight", (cfg.hidden,), torch.float32, device)
    tick("output_norm.weight")
    # The layers come after the head: packing the head (the largest weight) while no layer is
    # loaded yet keeps its transients off the VRAM peak (memory.vram counts them).
    layers: list[LayerWeights | None] = []
    for i in range(cfg.n_layers):
        if resident_layers is not None and i not in resident_layers:
            layers.append(None)
            continue
        layers.append(builder.build(src, i))
        release_transients(device)
        if progress is not None:
            start, end = layer_span(gf, i)
            progress(end - start)

    return ModelWeights(embed=embed, layers=layers, output_norm=output_norm, output=output,
                        rope_freqs=rope_freqs)
