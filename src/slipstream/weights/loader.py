"""Build a model's weight objects from a GGUF file for one device.

Private weights (`load_weights(private=...)`): GGUF tensors are read through the file's memory
map, and a weight that needs no conversion (the token embedding, kept in its GGUF format; F32
norms; F16 weights at float16 precision) would otherwise stay a view of that map. A view reads
the file at every use, so a file truncated under the running model kills the process with
SIGBUS on the next token, and one overwritten in place changes the model's output silently.
With `private` those views are copied into the process's own memory at load, and the map's pages
are given back to the page cache afterwards (they are clean file pages: nothing is lost), so a
resident model never touches its file again.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .. import envs, kernels, quant
from ..errors import BadArgument, GGUFError, InvalidMetadata, UnsupportedArchitecture
from ..model.families import spec_for
from ..model.families.gemma4 import PER_LAYER_MODEL_PROJ, PER_LAYER_PROJ_NORM, PER_LAYER_TOKEN_EMBD
from ..model.layer_spec import EMBEDDING, HEAD, LinearGroup, head_tensor_name, vector_field
from ..model.llama import LayerWeights
from ..model.per_layer import PerLayerEmbedding
from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..precision import Precision
from .checks import check_tensor_names, check_values
from .experts import build_experts
from .expert_ahead import wire as wire_read_ahead
from .expert_tiers import ExpertFile
from .split_build import SplitPlacement, SplitRuntime, SplitSpec
from .file_bytes import private_file_bytes, release_mapped_pages
from .prefetch import prefetch_dense
from .cpu import PackedDecodeLinear, kind_for, prefills_packed
from .cpu.kinds import pack_joined
from .image import flattened
from .source import TensorSource, layer_span, raw_tensor  # noqa: F401 (imported from here too)
from .linear import (GEMV_MAX_ROWS, DenseLinear, LazyDenseLinear, Linear, OnDemandDenseLinear,
                     QuantEmbedding, QuantLinear, Workspace, lazy_dense)


@dataclass
class ModelWeights:
    embed: QuantEmbedding | None  # None: a pipeline stage after the first (runtime.pipeline)
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # (hidden,)
    output: Callable[[torch.Tensor], torch.Tensor] | None  # hidden -> vocab (None: not last)
    rope_freqs: torch.Tensor | None  # (rope_dim/2,) frequency divisors (llama3, LongRoPE short)
    # LongRoPE (Phi-3): the divisors of contexts beyond `long_after` positions
    rope_freqs_long: torch.Tensor | None = None
    long_after: int = 0
    # the thread making the layers' dense weights after the load (prefetch_dense), or None
    dense_prefetch: threading.Thread | None = None
    # Gemma 4's per-layer embedding tables (model.per_layer), or None
    per_layer: PerLayerEmbedding | None = None
    # the file cold experts are read from, with their counters (weights.expert_tiers), or None
    experts: ExpertFile | SplitRuntime | None = None
    # the mapped image the packed decode copies are views of (memory.resident_image), or None
    packed_image: object | None = None

    def rope_freqs_for(self, ctx: int) -> torch.Tensor | None:
        """The divisors a context of `ctx` positions rotates with: LongRoPE's long set past
        the original context, as llama.cpp chooses (by the context allocated, not by how many
        tokens a pass holds), else the file's one set or none."""
        if self.rope_freqs_long is not None and ctx > self.long_after:
            return self.rope_freqs_long
        return self.rope_freqs


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
    spec = spec_for(cfg.architecture, cfg.n_experts)
    return max(max(spec.at(c).fused_elements(c) + _expert_elements(spec.at(c), c))
               for c in {cfg.layer(i) for i in range(cfg.n_layers)})


def _expert_elements(spec, cfg: ModelConfig) -> list[int]:
    """Elements of one expert's gate/up (fused) and down weights, which prefill dequantizes
    one at a time (weights.routed_experts); none for a dense layer."""
    if spec.experts is None:
        return []
    return [2 * cfg.expert_ffn * cfg.hidden]


class LayerBuilder:
    """Turns a layer's GGUF tensors into the weight objects the model math calls: dense
    float16/float32 linears on CPU, quantized weights repacked for the Triton kernels on CUDA.
    Resident loading and streaming both build layers here, so their numbers are identical."""

    def __init__(self, cfg: ModelConfig, device: torch.device, precision: Precision,
                 workspace: Workspace | None = None, fuse_scales: bool = True,
                 scratch_elements: int | None = None,
                 expert_slots: list[int] | None = None, expert_file: ExpertFile | None = None,
                 expert_split: SplitSpec | None = None):
        """fuse_scales=False (streamed layers): keep the smaller GGUF scale layout even where
        precision.fuse_scales folds the scales of resident layers into one plane for the
        decode kernels; both give the same results (see QuantLinear). scratch_elements: a
        cap on the prefill scratch below the largest layer weight (streamed plans).
        expert_slots (a mixture of experts, CPU): per layer, how many experts stay in RAM, the
        others read from `expert_file` when used (weights.expert_tiers); None: all in RAM.
        expert_split (a mixture of experts, CUDA): experts split between VRAM slots and the
        CPU (weights.split_build); None: every expert in VRAM."""
        self.cfg = cfg
        self.expert_split = expert_split
        self.expert_slots = expert_slots
        self.expert_file = expert_file
        self.device = device
        self.precision = precision
        self.fuse_scales = precision.fuse_scales and fuse_scales
        self.quantized = device.type == "cuda"
        self.workspace = workspace if workspace is not None else (
            Workspace(device, int8_activations=precision.int8_activations,
                      float32_products=precision.float32_products,
                      max_elements=min(prefill_scratch_elements(cfg),
                                       scratch_elements or float("inf")))
            if self.quantized else None)
        self.family_spec = spec_for(cfg.architecture, cfg.n_experts)
        self.spec = self.family_spec
        self.shapes = self.spec.shapes(cfg)
        if self.spec.experts is not None and self.quantized and expert_slots is not None:
            raise UnsupportedArchitecture(
                f"{cfg.architecture}: experts outside VRAM are not built on {device} (every "
                f"expert stays in VRAM, or the model runs with device='cpu')")

    def build(self, src: TensorSource, i: int, leave_out: frozenset[str] = frozenset()
              ) -> LayerWeights:
        """Layer i from `src`; the linears of the fields in `leave_out` are not built (None:
        the caller builds them its own way, as hybrid's split does the FFN)."""
        p = f"blk.{i}"
        # layer i's tensors and shapes (ModelConfig.layer: Gemma 4's layers differ)
        layer_cfg = self.cfg.layer(i)
        self.spec = self.family_spec.at(layer_cfg)
        self.shapes = self.spec.shapes(layer_cfg)
        fields: dict[str, object] = {}
        for group in self.spec.linears:
            if group.field in leave_out:
                continue
            fused, parts = self._linears(src, [f"{p}.{n}" for n in group.parts], group)
            if len(group.parts) > 1:
                fields[group.field] = fused
                fields.update(zip(group.parts, parts or [None] * len(group.parts)))
            else:  # one stored tensor: its own field, or the fused field it already is (Phi-3)
                fields[group.field] = parts[0]
        for norm in self.spec.norms:
            shape = self.shapes.get(f"{norm}.weight")
            if shape is None:  # an optional vector the file lacks (Gemma 4's output scale)
                continue
            fields[norm] = src.dense(f"{p}.{norm}.weight", shape, torch.float32, self.device)
        for vector in self.spec.vectors:  # (float32 tensors named otherwise: Qwen3.5's ssm_a)
            fields[vector_field(vector)] = src.dense(f"{p}.{vector}", self.shapes[vector],
                                                     torch.float32, self.device)
        if self.spec.experts is not None:
            slots = self.expert_slots[i] if self.expert_slots is not None else None
            fields["moe"] = build_experts(self, src, p, slots, self.expert_file, fields)
        for f in dataclasses.fields(LayerWeights):  # the parts a fused-only layout lacks
            fields.setdefault(f.name, None)
        return LayerWeights(**fields)

    def _linears(self, src: TensorSource, prefixes: list[str], group: LinearGroup
                 ) -> tuple[Callable | None, list[Callable]]:
        """The layers for `prefixes` (the group's parts in layer i), plus one fused layer over
        all of them where the group's fusion rule allows it (None otherwise)."""
        shapes = [self.shapes[f"{n}.weight"] for n in group.parts]
        biases = [src.dense(f"{p}.bias", (s[0],), torch.float32, self.device)
                  if src.has(f"{p}.bias") else None for p, s in zip(prefixes, shapes)]
        if not self.quantized:
            if src.lazy:
                return self._lazy_linears(src, prefixes, shapes, biases, group)
            dtype = self.precision.weight_dtype
            parts = [DenseLinear(src.dense(f"{p}.weight", s, dtype, self.device), b)
                     for p, s, b in zip(prefixes, shapes, biases)]
            if not group.fuses((), dense=True):
                return None, [self._packed_decode(src, [p], [s], [b], d)
                              for p, s, b, d in zip(prefixes, shapes, biases, parts)]
            fused, views = DenseLinear.fuse(parts)
            return self._packed_decode(src, prefixes, shapes, biases, fused), views
        # GPU: the weights stay quantized, repacked for the kernels. Rows of the same format
        # concatenate into one packed weight, so q/k/v (gate/up) cost one kernel launch.
        types = [src.type_of(f"{p}.weight") for p in prefixes]
        raws = [src.raw(f"{p}.weight", s).to(self.device) for p, s in zip(prefixes, shapes)]
        if group.fuses(types):
            rows = sum(s[0] for s in shapes)
            packed = kernels.pack_weight(torch.cat(raws), types[0], rows, shapes[0][1])
            bias = (torch.cat([b if b is not None else torch.zeros(s[0], device=self.device)
                               for b, s in zip(biases, shapes)])
                    if any(b is not None for b in biases) else None)
            return QuantLinear(packed, bias, self.workspace, self.fuse_scales), []
        parts = [QuantLinear(kernels.pack_weight(r, t, *s), b, self.workspace, self.fuse_scales)
                 for r, t, s, b in zip(raws, types, shapes, biases)]
        return None, parts


    def _lazy_linears(self, src: TensorSource, prefixes: list[str], shapes, biases,
                      group: LinearGroup) -> tuple[Callable | None, list[Callable]]:
        """The CPU linears of a group from the memory-mapped file, with dense weights made at
        their first use (linear.LazyDenseLinear) from the GGUF bytes read once here, which the
        packed decode copy is made from too."""
        dtype = self.precision.weight_dtype
        raws = [src.raw_held(f"{p}.weight", s) for p, s in zip(prefixes, shapes)]
        types = [src.type_of(f"{p}.weight") for p in prefixes]
        parts = [lazy_dense(r, t, s, dtype, b)
                 for r, t, s, b in zip(raws, types, shapes, biases)]
        if not group.fuses((), dense=True):
            return None, [self._packed_decode(src, [p], [s], [b], d, raws=[r])
                          for p, s, b, d, r in zip(prefixes, shapes, biases, parts, raws)]
        fused, views = LazyDenseLinear.fuse(parts)
        return self._packed_decode(src, prefixes, shapes, biases, fused, raws=raws), views

    def _packed_decode(self, src: TensorSource, prefixes: list[str], shapes, biases,
                       dense: Linear, raws: list[torch.Tensor] | None = None):
        """`dense` with a packed copy for decode (precision.cpu_packed_decode), when the
        tensors' formats pack into one layout; else `dense` alone. `raws`: the weights' GGUF
        bytes, already copied (else copied here)."""
        if not self.precision.cpu_packed_decode:
            return dense
        types = [src.type_of(f"{p}.weight") for p in prefixes]
        if any(kind_for(t) is None for t in types):
            return dense
        # the bytes copied now: packing waits for the first decode step, and the model's file
        # must not be read after the load (private weights, see the module doc)
        if raws is None:
            raws = [src.raw(f"{p}.weight", s).clone() for p, s in zip(prefixes, shapes)]
        return self._packed(types, shapes, biases, dense, raws)

    def _packed(self, types, shapes, biases, dense: Linear, raws: list[torch.Tensor]):
        """_packed_decode over GGUF bytes already held (`raws`, with their `types`)."""
        if not self.precision.cpu_packed_decode or any(kind_for(t) is None for t in types):
            return dense
        # up to GEMV_MAX_ROWS tokens, as DenseLinear's own matvec path: a row's bits then do
        # not depend on how many rows share its call (the server's chunked prefill relies on
        # it); a prompt that short pays the packing, a longer one leaves it to the first step
        return PackedDecodeLinear(dense, lambda: pack_joined(raws, types, shapes, biases),
                                  GEMV_MAX_ROWS, packed_prefill=prefills_packed(types))


def check_layer_shapes(gf: GGUFFile, cfg: ModelConfig) -> None:
    """Every per-layer tensor exists with the shape the metadata implies (before any byte of
    it is read, so a streamed layer cannot fail half-way through a generation)."""
    family_spec = spec_for(cfg.architecture, cfg.n_experts)
    for i in range(cfg.n_layers):
        spec = family_spec.at(cfg.layer(i))
        shapes = spec.shapes(cfg.layer(i))
        optional = {t.suffix for t in spec.tensors if t.optional}
        for suffix, shape in shapes.items():
            name = f"blk.{i}.{suffix}"
            info = gf.tensors.get(name)
            if info is None:
                if suffix in optional:
                    continue
                raise GGUFError(f"{gf.path.name}: missing tensor {name!r}")
            if tuple(info.shape) != tuple(shape):
                raise GGUFError(f"{gf.path.name}: tensor {name!r} has shape {list(info.shape)}, "
                                f"expected {list(shape)} from the model metadata")
    check_tensor_names(gf, cfg)  # renamed tensors, then the unused ones in one warning


def load_weights(gf: GGUFFile, cfg: ModelConfig, device: torch.device, precision: Precision,
                 progress: Callable[[int], None] | None = None,
                 resident_layers: set[int] | None = None,
                 embed_on_host: bool = False, private: bool | None = None,
                 scratch_elements: int | None = None,
                 fuse_scales: bool = True, head_dense_on_demand: bool = False,
                 flat_layers: bool = False, holds_embedding: bool = True,
                 holds_head: bool = True,
                 expert_slots: list[int] | None = None,
                 expert_split: SplitPlacement | None = None,
                 layer_sources: Callable[[list[int]], Iterable[tuple[int, TensorSource]]]
                 | None = None) -> ModelWeights:
    """Build the model's weights on `device`: every layer, or only `resident_layers` (the
    others are left as None for a streaming store to fill). Norms stay float32.
    `layer_sources(layers)`: (i, source) for each of a dense model's layers in order, where
    they come from somewhere else than the map (memory.layer_reads.staged_sources).
    `embed_on_host`: the token embedding stays in host memory (see QuantEmbedding).
    `private`: no weight stays a view of the file's memory map (see the module doc); None
    (auto) is True on CPU, where it costs the embedding table's GGUF bytes (28.7 MiB for the
    default model, whose RSS still ends lower: the file's pages are dropped), and False on
    CUDA, where only an `embed_on_host` embedding would view the map and RAM is what a
    streamed plan is short of.

    `scratch_elements`, `fuse_scales`: the prefill scratch's cap, and whether resident layers
    may fold their scales (memory.planner.Plan: a streamed plan does neither).
    `head_dense_on_demand` (CPU, with packed decode copies): the head keeps its GGUF bytes
    instead of its dense weight, which calls of more than GEMV_MAX_ROWS rows dequantize
    (linear.OnDemandDenseLinear: the same bits); decode goes through its packed copy.

    `flat_layers` (CUDA): each layer in one device buffer laid out as its image
    (weights.image.flattened: no allocator holes between the layers; a streamed plan, which
    sizes its resident layers so, memory.vram.layer_flat_bytes).

    `holds_embedding`, `holds_head`: False for a pipeline stage that is not the first / the
    last (runtime.pipeline): that weight is not loaded (None).

    `expert_slots` (a mixture of experts on the CPU): per layer, how many of its experts stay
    in RAM; the others are read from the file when a token routes to them
    (weights.expert_tiers). None: every expert in RAM.

    `expert_split` (a mixture of experts on CUDA): per layer, the experts in VRAM slots and
    those the CPU holds in RAM (weights.split_build); None: every expert in VRAM.

    `progress(n_bytes)` is called after each layer so callers can drive a progress bar.
    """
    if private is None:
        private = device.type == "cpu"
    if cfg.n_experts and resident_layers is not None and \
            len(resident_layers) < cfg.n_layers and holds_embedding and holds_head:
        raise UnsupportedArchitecture(
            f"{gf.path.name}: a mixture-of-experts model is loaded whole (every layer "
            f"resident); streaming its layers, and placing its experts across VRAM, RAM and "
            f"disk, is not built yet: give a budget that holds the model")
    for name, info in gf.tensors.items():
        quant.get_format(info.ggml_type)  # unsupported types fail here, naming the type
    check_layer_shapes(gf, cfg)
    # with experts left in the file, not every weight's bytes are kept: none read whole
    whole = (resident_layers is None or len(resident_layers) == cfg.n_layers) \
        and holds_embedding and holds_head and expert_slots is None
    held = None
    if private and device.type == "cpu" and whole:
        # every weight's bytes are kept, so read them in one pass (private_file_bytes), and
        # first: the checks below then read those pages from the page cache, where on a cold
        # cache their strided reads of the map pulled the file in page by page
        held = private_file_bytes(gf)
    else:
        gf.__dict__.pop("_read_ahead", None)  # a read started for nothing: dropped
    # before a byte is built: only what this load reads (a streamed layer's norms and biases,
    # not its weights, which are read per token); 11 ms of the default model's 0.4 s
    check_values(gf, cfg, resident_layers, holds_embedding, holds_head,
                 experts=expert_slots is None and expert_split is None)
    if expert_slots is not None and (device.type != "cpu" or len(expert_slots) != cfg.n_layers):
        raise BadArgument(f"expert_slots={expert_slots!r}: one count per layer "
                          f"({cfg.n_layers}), on the CPU only")
    expert_file = ExpertFile(gf.path) if expert_slots is not None else None
    split = None
    if expert_split is not None:
        cpu = torch.device("cpu")
        split = expert_split.spec(gf.path, device, cfg.hidden, LayerBuilder(
            cfg, cpu, Precision.of(precision.name, cpu)), cfg.n_layers)
    builder = LayerBuilder(cfg, device, precision, fuse_scales=fuse_scales,
                           scratch_elements=scratch_elements, expert_slots=expert_slots,
                           expert_file=expert_file,
                           expert_split=split)
    workspace = builder.workspace
    quantized = builder.quantized
    if held is not None:
        src = TensorSource(gf, *held, private=private, held=True)
    else:
        src = TensorSource(gf, private=private)

    def tick(name: str) -> None:
        if progress is not None and name in gf.tensors:
            progress(gf.tensors[name].n_bytes)

    embed_shape = (cfg.vocab_size, cfg.hidden)
    embed_info = gf.tensors.get(EMBEDDING)
    embed_raw, embed = None, None
    pinned = False
    if holds_embedding or (head_dense_on_demand and holds_head):
        embed_raw = src.raw(EMBEDDING, embed_shape)  # the map's view, or a held buffer's
        if not embed_on_host:
            embed_raw = embed_raw.to(device)  # on CPU still the map's bytes
        elif device.type == "cuda" and envs.get("SLIPSTREAM_PINNED_EMBED"):
            # the GPU reads the pinned host table itself (kernels.host_rows), so a decode
            # step's lookup needs no host sync: 0.4-0.9 GiB (8B-70B) of pinned RAM beside the
            # budget. Off until measured on a GPU
            embed_raw, pinned = embed_raw.contiguous().pin_memory(), True  # a private copy
        if (private or src.held) and embed_raw.device.type == "cpu" and not pinned:
            # copied out of a held buffer too: the model keeps the table, and a view would keep
            # the whole buffer (every layer's GGUF bytes) after the layers are made from it
            embed_raw = embed_raw.clone()
    if holds_embedding:
        embed = QuantEmbedding(embed_raw, embed_info.ggml_type, cfg.hidden,
                               precision.act_dtype, device, pinned=pinned)
    tick(EMBEDDING)
    head_name = head_tensor_name(gf.tensors)  # the embedding where the file ties them
    if not holds_head:
        output = None
    elif quantized:
        head_raw = raw_tensor(gf, head_name, embed_shape).to(device)
        packed = kernels.pack_weight(head_raw, gf.tensors[head_name].ggml_type, *embed_shape)
        del head_raw  # before QuantLinear reserves the prefill workspace
        output = QuantLinear(packed, None, workspace)
        release_transients(device)
    elif head_dense_on_demand:
        # a head tied to the embedding shares its bytes (already copied where private)
        raw = embed_raw if head_name == EMBEDDING else raw_tensor(gf, head_name, embed_shape)
        if private and head_name != EMBEDDING:
            raw = raw.clone()
        dense = OnDemandDenseLinear(raw, gf.tensors[head_name].ggml_type, embed_shape,
                                    precision.weight_dtype)
        output = builder._packed_decode(src, [head_name.removesuffix(".weight")],
                                        [embed_shape], [None], dense, raws=[raw])
    else:
        # a head tied to the embedding shares its bytes (already copied where private); its
        # dense weight is made at the first call of more than GEMV_MAX_ROWS rows, as a layer's
        raw = embed_raw if head_name == EMBEDDING and embed_raw is not None else \
            src.raw_held(head_name, embed_shape)
        if src.held and raw is not embed_raw:
            raw = raw.clone()  # held until its first use, maybe never: not a view (as above)
        dense = lazy_dense(raw, gf.tensors[head_name].ggml_type, embed_shape,
                           precision.weight_dtype)
        output = builder._packed_decode(src, [head_name.removesuffix(".weight")],
                                        [embed_shape], [None], dense, raws=[raw])
    if head_name == HEAD:
        tick(head_name)
    rope_freqs = _rope_divisors(src, "rope_freqs.weight", cfg)
    rope_long = None
    if "rope_factors_short.weight" in gf.tensors or "rope_factors_long.weight" in gf.tensors:
        rope_freqs = _rope_divisors(src, "rope_factors_short.weight", cfg, required=True)
        rope_long = _rope_divisors(src, "rope_factors_long.weight", cfg, required=True)
    output_norm = src.dense("output_norm.weight", (cfg.hidden,), torch.float32, device)
    tick("output_norm.weight")
    per_layer = (load_per_layer(src, cfg, device, precision, embed_on_host)
                 if cfg.per_layer_dim and holds_embedding else None)
    # The layers come after the head: packing the head (the largest weight) while no layer is
    # loaded yet keeps its transients off the VRAM peak (memory.vram counts them).
    layers: list[LayerWeights | None] = [None] * cfg.n_layers
    built = [i for i in range(cfg.n_layers) if resident_layers is None or i in resident_layers]
    # the layers from `layer_sources` where given (a CUDA load's locked staging,
    # memory.layer_reads), else from the map or the held buffer
    staged = layer_sources is not None and held is None
    for i, layer_src in layer_sources(built) if staged else ((i, src) for i in built):
        layer = builder.build(layer_src, i)
        if flat_layers and builder.quantized:
            release_transients(device)  # the build's, before the layer takes its buffer
            layer = flattened(layer, workspace)
        layers[i] = layer
        release_transients(device)
        if progress is not None:
            start, end = layer_span(gf, i)
            progress(end - start)

    if expert_file is not None:  # layer i guesses layer i+1's cold experts, read ahead
        wire_read_ahead(cfg, layers)
    if private:
        release_mapped_pages(gf)
    return ModelWeights(embed=embed, layers=layers, output_norm=output_norm, output=output,
                        rope_freqs=rope_freqs, rope_freqs_long=rope_long,
                        long_after=cfg.rope_ctx_orig, per_layer=per_layer,
                        experts=expert_file if split is None else split.runtime,
                        dense_prefetch=prefetch_dense(layers, output)
                        if src.lazy and not quantized else None)


def load_per_layer(src: TensorSource, cfg: ModelConfig, device: torch.device,
                   precision: Precision, on_host: bool) -> PerLayerEmbedding:
    """Gemma 4's per-layer embedding tables (model.per_layer). The token table (vocab x
    n_layers x 256: 2.3 G values in E2B, more than its layers) stays in its GGUF format,
    where the token embedding stays (`on_host`: in host memory), and a pass dequantizes only
    its tokens' rows; the projection is a linear of the layers' kind."""
    width = cfg.n_layers * cfg.per_layer_dim
    raw = src.raw_held(PER_LAYER_TOKEN_EMBD, (cfg.vocab_size, width))
    if not on_host:
        raw = raw.to(device)
    table = QuantEmbedding(raw, src.type_of(PER_LAYER_TOKEN_EMBD), width, torch.float32,
                           device)
    shape = (width, cfg.hidden)
    if device.type == "cuda":
        packed = kernels.pack_weight(src.raw(PER_LAYER_MODEL_PROJ, shape).to(device),
                                     src.type_of(PER_LAYER_MODEL_PROJ), *shape)
        proj: Callable = QuantLinear(packed, None, Workspace(
            device, max_elements=width * cfg.hidden))
    else:
        proj = DenseLinear(src.dense(PER_LAYER_MODEL_PROJ, shape, precision.weight_dtype,
                                     device))
    norm = src.dense(PER_LAYER_PROJ_NORM, (cfg.per_layer_dim,), torch.float32, device)
    return PerLayerEmbedding(table, proj, norm)


def _rope_divisors(src: TensorSource, name: str, cfg: ModelConfig,
                   required: bool = False) -> torch.Tensor | None:
    """A (rope_dim / 2,) tensor of RoPE frequency divisors (llama3's rope_freqs, LongRoPE's
    rope_factors_short/long), checked: a zero, negative or non-finite divisor would make every
    logit NaN. None where the file lacks it and it is not `required` (LongRoPE's two come
    together)."""
    if not src.has(name):
        if required:
            raise GGUFError(f"{src.gf.path.name}: missing tensor {name!r} (LongRoPE files "
                            f"hold rope_factors_short.weight and rope_factors_long.weight)")
        return None
    t = src.dense(name, (cfg.rope_dim // 2,), torch.float32, torch.device("cpu"))
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise InvalidMetadata(f"{src.gf.path.name}: tensor {name!r} has value {float(t[i])!r} "
                              f"at index {i}; RoPE frequency divisors must be finite and "
                              f"positive")
    return t
