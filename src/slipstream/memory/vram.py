"""What the GPU side of a model takes, computed from the GGUF index and the engine's shapes,
without building anything: layer sizes in VRAM and as images, and the reserve the planner keeps
out of the VRAM budget (KV cache, activations, workspace, slots, graph pools, load transients).

Sizes follow kernels/pack.py's plane layout and the CUDA caching allocator's rounding; the GPU
tests compare them with what loading really allocates.
"""

from __future__ import annotations

import math

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..kernels.pack import QSPECS, pack_chunk_rows, sm_width  # tables: no CUDA nor Triton
from ..kernels.pack_iq import IQ_PLANES
from ..model.families import family_for, spec_for
from ..model.families.gemma4 import PER_LAYER_TOKEN_EMBD
from ..model.layer_spec import EMBEDDING, head_tensor_name, kv_cache_bytes
from ..weights.image import IMAGE_ALIGN  # every tensor of an image starts on this boundary
from ..weights.loader import prefill_scratch_elements
from ..weights.split_experts import SLOT_WRITE_ROWS
from .expert_plan import expert_projections

_FLOAT_BYTES = {T.F32: 4, T.F16: 2, T.BF16: 2}
# torch's caching allocator: requests round to 512 B; requests of 10 MiB and more get their own
# segment rounded to 2 MiB; smaller ones share 2 MiB (<= 1 MiB) or 20 MiB segments.
_SMALL_ROUND, _LARGE_ROUND, _LARGE_MIN = 512, 2 << 20, 10 << 20
SHARED_SEGMENTS = (2 << 20) + (20 << 20)  # one partly used small and mid-size segment
CUBLAS_WORKSPACE = 32 << 20  # per stream that runs GEMMs (torch's default on sm90)
PACK_TEMP_BYTES = 24  # per weight of one packed chunk: ~3 live int64 temporaries


def alloc_bytes(n: int) -> int:
    """What one CUDA tensor of n bytes takes from the allocator."""
    if n >= _LARGE_MIN:
        return -(-n // _LARGE_ROUND) * _LARGE_ROUND
    return -(-max(n, 1) // _SMALL_ROUND) * _SMALL_ROUND


def packed_planes(qtype: int, rows: int, cols: int, fused: bool = False) -> list[int]:
    """Byte sizes of the planes kernels.pack_weight makes for a (rows, cols) weight; `fused`:
    after pack.fuse_scales (precision="fast"), which replaces the scale planes by one f16
    plane of sm_width entries per 32 weights where the format has more than a plain d."""
    qt = T(int(qtype))
    if qt in _FLOAT_BYTES:
        return [rows * cols * _FLOAT_BYTES[qt]]
    s = QSPECS[qt]
    if s.iq:  # GGUF's fields, a plane each; fuse_scales leaves them as they are
        return [rows * cols // 256 * size for size in IQ_PLANES[qt].values()]
    planes = [rows * cols * s.lo // 8]
    if s.hi:
        planes.append(rows * cols * s.hi // 8)
    if fused and sm_width(s):
        return planes + [rows * cols // 32 * sm_width(s) * 2]
    # f16 d (and m); MXFP4's d is float32
    scales = rows * (cols // 256 if s.kquant else cols // 32) * (4 if s.f32_scale else 2)
    planes += [scales] * (2 if s.has_min else 1)
    if s.kquant:
        planes.append(rows * cols // s.group)  # sc
        if s.has_min and not s.packed_scmn:
            planes.append(rows * cols // s.group)  # mn
    return planes


def _linears(gf: GGUFFile, cfg: ModelConfig, i: int) -> list[tuple[int, int, int, int]]:
    """(qtype, rows, cols, bias rows) of each linear LayerBuilder makes for layer i: q/k/v and
    gate/up fuse when their formats agree (model.layer_spec)."""
    lc = cfg.layer(i)  # layer i's (Gemma 4's layers differ)
    spec = spec_for(cfg.architecture, cfg.n_experts).at(lc)
    shapes = spec.shapes(lc)
    out = []
    for group in spec.linears:
        names = [f"blk.{i}.{p}.weight" for p in group.parts]
        types = [gf.tensors[n].ggml_type for n in names]
        cols = gf.tensors[names[0]].shape[1]
        rows = [shapes[f"{p}.weight"][0] for p in group.parts]
        biased = [f"blk.{i}.{p}.bias" in gf.tensors for p in group.parts]
        if group.fuses(types):
            out.append((int(types[0]), sum(rows), cols, sum(rows) if any(biased) else 0))
        else:
            out.extend((int(t), r, cols, r if b else 0) for t, r, b in zip(types, rows, biased))
    return out


def _expert_linears(gf: GGUFFile, cfg: ModelConfig, i: int, stacked: bool = True
                    ) -> list[tuple[int, int, int, int]]:
    """(qtype, rows, cols, bias rows) of the stacked expert weights weights.experts makes on
    CUDA for layer i (every expert's rows in one weight: gate and up together where their
    formats agree), none for a dense layer; `stacked` False: one expert's (the unit of a
    split plan's VRAM slots, memory.expert_split_plan)."""
    spec = spec_for(cfg.architecture, cfg.n_experts).at(cfg.layer(i)).experts
    if spec is None:
        return []
    biased = [f"blk.{i}.{p}.bias" in gf.tensors for p in (spec.gate, spec.up, spec.down)]
    # gate, up and down (gate and up perhaps the halves of one tensor: expert_projections)
    n = cfg.n_experts if stacked else 1
    stacked = [(int(p.ggml_type), n * p.rows, p.cols, n * p.rows if b else 0)
               for p, b in zip(expert_projections(gf, cfg, i), biased)]
    if stacked[0][0] == stacked[1][0]:
        gate, up = stacked[:2]
        both = gate[3] + up[3] if gate[3] or up[3] else 0
        stacked = [(gate[0], gate[1] + up[1], gate[2], both), stacked[2]]
    return stacked


def _layer_tensors(gf: GGUFFile, cfg: ModelConfig, i: int, fused: bool,
                   experts: bool = True) -> list[int]:
    """Byte sizes of layer i's tensors as held on CUDA; `experts` False: without its routed
    experts (a split plan's dense part)."""
    lc = cfg.layer(i)  # layer i's (Gemma 4's layers differ)
    spec = spec_for(cfg.architecture, cfg.n_experts).at(lc)
    shapes = spec.shapes(lc)
    sizes = [math.prod(shapes[f"{n}.weight"]) * 4 for n in spec.norms  # float32
             if f"{n}.weight" in shapes]
    sizes += [math.prod(shapes[v]) * 4 for v in spec.vectors]
    if spec.experts is not None:  # the router, float32, and its bias (gpt-oss)
        sizes += [math.prod(shapes[f"{spec.experts.router}.weight"]) * 4]
        if f"blk.{i}.{spec.experts.router}.bias" in gf.tensors:
            sizes.append(cfg.n_experts * 4)
    routed = _expert_linears(gf, cfg, i) if experts else []
    for qtype, rows, cols, bias in _linears(gf, cfg, i) + routed:
        sizes += packed_planes(qtype, rows, cols, fused)
        if bias:
            sizes.append(bias * 4)
    return sizes


def layer_image_bytes(gf: GGUFFile, cfg: ModelConfig, i: int, fused: bool = False) -> int:
    """Size of layer i's image (gpu_stream.to_image): what one slot holds and one copy moves."""
    return sum(-(-n // IMAGE_ALIGN) * IMAGE_ALIGN for n in _layer_tensors(gf, cfg, i, fused))


def layer_vram_bytes(gf: GGUFFile, cfg: ModelConfig, i: int, fused: bool = False) -> int:
    """VRAM layer i takes when resident (each plane its own allocation)."""
    return sum(alloc_bytes(n) for n in _layer_tensors(gf, cfg, i, fused))


def layer_dense_vram_bytes(gf: GGUFFile, cfg: ModelConfig, i: int, fused: bool = False) -> int:
    """VRAM layer i takes resident without its routed experts (attention, norms, router, a
    shared expert): the part of a mixture of experts a split plan always holds."""
    return sum(alloc_bytes(n) for n in _layer_tensors(gf, cfg, i, fused, experts=False))


def expert_planes(gf: GGUFFile, cfg: ModelConfig, i: int, fused: bool = False) -> list[int]:
    """Byte sizes of one routed expert's planes and biases in layer i's VRAM slot stacks (the
    slots of a projection share one allocation per plane: slot_stack_bytes)."""
    sizes = []
    for qtype, rows, cols, bias in _expert_linears(gf, cfg, i, stacked=False):
        sizes += packed_planes(qtype, rows, cols, fused) + ([bias * 4] if bias else [])
    return sizes


def expert_layout(gf: GGUFFile, cfg: ModelConfig, i: int) -> tuple:
    """What makes layer i's experts' slot stacks alike or not: (qtype, rows, cols, bias rows)
    of one expert's stacked projections (a split prefill's staging slots are shared by the
    layers of one layout, weights.expert_stream)."""
    return tuple(_expert_linears(gf, cfg, i, stacked=False))


def expert_vram_bytes(gf: GGUFFile, cfg: ModelConfig, i: int, fused: bool = False) -> int:
    """VRAM one routed expert of layer i takes in a VRAM slot, before the allocator's
    rounding of the stacks."""
    return sum(expert_planes(gf, cfg, i, fused))


def slot_stack_bytes(planes: list[int], slots: int, n_experts: int) -> int:
    """VRAM of a layer's `slots` VRAM slots, one allocation per plane (expert_planes), and of
    its expert-id -> slot map on the device (int64)."""
    if not slots:
        return 0
    return sum(alloc_bytes(slots * p) for p in planes) + alloc_bytes(n_experts * 8)


def layer_flat_bytes(gf: GGUFFile, cfg: ModelConfig, i: int) -> int:
    """VRAM layer i takes resident in one buffer laid out as its image (weights.image.flattened,
    streamed plans): one allocation."""
    return alloc_bytes(layer_image_bytes(gf, cfg, i))


def write_transient(qtype: int, rows: int, cols: int) -> int:
    """Extra VRAM while `rows` rows of a (rows, cols) weight of GGML type `qtype` are packed
    from their GGUF bytes (a slot's write: weights.split_experts.SlotStacks.write_parts)."""
    block, tsize = GGML_QUANT_SIZES[T(qtype)]
    return _pack_transient(qtype, rows, cols, rows * cols // block * tsize)


def _pack_transient(qtype: int, rows: int, cols: int, raw: int) -> int:
    """Extra VRAM while one weight is packed at load: its raw bytes (twice when fused parts are
    concatenated), the per-chunk parts and their concatenation, and the int64 temporaries of
    one chunk (fuse_scales' f32 temporaries are far smaller than these)."""
    packed = sum(packed_planes(qtype, rows, cols))
    return 2 * raw + 2 * packed + PACK_TEMP_BYTES * pack_chunk_rows(rows, cols) * cols


def extra_tensor_bytes(gf: GGUFFile, cfg: ModelConfig, table_on_host: bool) -> int:
    """Bytes of the non-layer tensors a family reads beyond the embedding, head and final
    norm (model.families.Family.top_tensors: Gemma 4's per-layer embedding tables, as held:
    in their GGUF format, the token table left out where it stays on the host like the
    embedding)."""
    return sum(alloc_bytes(gf.tensors[n].n_bytes)
               for n in family_for(cfg.architecture).top_tensors(cfg)
               if n in gf.tensors and not (table_on_host and n == PER_LAYER_TOKEN_EMBD))


def activation_bytes(cfg: ModelConfig, chunk: int, ctx: int) -> int:
    """Peak activations of one prefill chunk through one block (weights excluded), with the
    attention scores counted as SDPA's math path would materialise them (an upper bound)."""
    q, kv, h, f = cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.hidden, cfg.ffn
    per_token = (4 * h * 4  # x, the normed h, the residual sum, the attention output (f32)
                 + (q + 2 * kv) * 4 * 2  # qkv and the roped q/k (f32)
                 + q * 2 + h * 2  # fp16 copies of q and of the GEMM input
                 + 2 * f * 4 + 2 * f * 4 + f * 2)  # gate_up, silu(gate) and the product, fp16
    scores = cfg.n_heads * chunk * ctx * 2
    mask = cfg.gqa_group * chunk * ctx
    logits = cfg.vocab_size * 4 * 2
    return chunk * per_token + scores + mask + logits


def vram_reserve(gf: GGUFFile, cfg: ModelConfig, ctx: int, kv_bytes_per_elem: int,
                 chunk: int, graphs: bool, fused: bool = False,
                 embed_on_host: bool = False, *, graph_bucket: int,
                 kv_layers: int | range | None = None, holds_embedding: bool = True,
                 holds_head: bool = True, scratch_cap: int | None = None,
                 stacked_experts: bool = True) -> dict[str, int]:
    """VRAM the engine needs besides the layers and the streaming slots, by part.
    `embed_on_host`: the token embedding stays in host memory (streamed plans).
    `chunk`, `graph_bucket`: the engine's prefill chunk and CUDA graph bucket (one graph per
    `graph_bucket` positions of ctx), passed in because memory/ never imports runtime/.

    Per stage of a model split over devices: `kv_layers` (default all), the layers whose KV
    cache the stage holds, and whether it holds the token embedding and the head (the
    activations are counted whole on every stage, an upper bound).

    Loading and running peak at different times (api.load empties the allocator's cache in
    between), so the reserve holds the larger of the load-time transients and the run-time
    extras (KV cache, activations, graph pools, cuBLAS workspaces).

    `scratch_cap`: elements the prefill scratch is held to (streamed plans: weights larger
    than that are dequantized and multiplied in row chunks, weights.linear.Workspace).

    `stacked_experts` False (a split plan's VRAM slots): the experts are packed one at a
    time, so the load transients are one expert's, not a whole stacked projection's."""
    head = gf.tensors[head_tensor_name(gf.tensors)]
    head_weight = (int(head.ggml_type), *head.shape, head.n_bytes)  # (vocab, hidden)
    layer_weights = [(qtype, rows, cols, rows * cols // GGML_QUANT_SIZES[T(qtype)][0]
                      * GGML_QUANT_SIZES[T(qtype)][1])
                     for qtype, rows, cols, _ in _linears(gf, cfg, 0)
                     + _expert_linears(gf, cfg, 0, stacked_experts)]
    weights = [head_weight] + layer_weights if holds_head else layer_weights
    # prefill dequantizes one weight at a time into one fp16 scratch, at most the largest
    # layer weight (the head goes in row chunks; weights.linear.Workspace)
    scratch = min(prefill_scratch_elements(cfg), max(r * c for _, r, c, _ in weights))
    if scratch_cap is not None:
        scratch = min(scratch, scratch_cap)
    parts = {
        "embedding": (alloc_bytes(gf.tensors[EMBEDDING].n_bytes)
                      if holds_embedding and not embed_on_host else 0),
        "head": (sum(alloc_bytes(n) for n in packed_planes(*head_weight[:3], fused))
                 if holds_head else 0),
        "per-layer embeddings": (extra_tensor_bytes(gf, cfg, embed_on_host)
                                 if holds_embedding else 0),
        "prefill workspace": alloc_bytes(2 * scratch),
        "norms, rope, allocator": SHARED_SEGMENTS + 2 * ctx * cfg.rope_dim * 4,
    }
    kv = kv_cache_bytes(cfg, range(cfg.n_layers) if kv_layers is None else kv_layers, ctx,
                        kv_bytes_per_elem)
    act = activation_bytes(cfg, min(chunk, ctx), ctx)
    n_graphs = math.ceil(ctx / graph_bucket) if graphs else 0
    graph_pool = alloc_bytes(activation_bytes(cfg, 1, ctx)) + (2 << 20)
    run = {"KV cache": kv, "activations": act, "CUDA graph pools": n_graphs * graph_pool,
           "cuBLAS workspaces": 2 * CUBLAS_WORKSPACE}
    parts.update(run)
    # load_weights packs the head before any layer, when little else is held; the layers'
    # transients come on top of the layers already loaded
    packed_at_once = layer_weights
    if not stacked_experts:
        # a split plan's slots are written SLOT_WRITE_ROWS rows at a time, at the load and in
        # every swap (weights.split_experts): a gpt-oss-120b expert's gate/up whole would
        # take 416 MiB of int64 temporaries, 256 rows of it 18 MiB
        packed_at_once = [(q, r, c, raw) for q, r, c, _ in _linears(gf, cfg, 0)
                          for raw in [r * c // GGML_QUANT_SIZES[T(q)][0]
                                      * GGML_QUANT_SIZES[T(q)][1]]]
        slot_writes = [(q, min(r, SLOT_WRITE_ROWS), c,
                        min(r, SLOT_WRITE_ROWS) * c // GGML_QUANT_SIZES[T(q)][0]
                        * GGML_QUANT_SIZES[T(q)][1])
                       for q, r, c, _ in _expert_linears(gf, cfg, 0, stacked=False)]
        packed_at_once = packed_at_once + slot_writes
        # a swap's write runs beside the decode's own work, not in the load's place
        parts["expert slot writes"] = max(_pack_transient(*w) for w in slot_writes)
    load = max(_pack_transient(*w) for w in packed_at_once)
    if load > sum(run.values()):
        parts["load transients (beyond the above)"] = load - sum(run.values())
    return parts
