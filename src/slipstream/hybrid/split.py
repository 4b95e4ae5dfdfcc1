"""Hybrid decode's split of a streamed layer: the CPU computes part of the FFN from packed host
weights while PCIe brings the rest of the layer to the GPU.

The split runs along the FFN's intermediate dimension. The GPU keeps intermediate units
[0, keep): rows [0, keep) of gate and up and columns [0, keep) of down; the CPU takes
[keep, ffn). Each side then ends with a partial sum of the down projection over its own units,
so one exchange per layer suffices: the normed input goes to the host, the CPU's partial sum
comes back and is added on the GPU. The FFN is about 80% of a Llama layer's bytes, more than
the CPU's share ever needs to be, and attention stays whole on the GPU.

A split layer keeps its whole FFN in GPU format as well, the units past `keep` in two more
linears (`ffn_gate_up_rest`, `ffn_down_rest`) laid out at the end of the layer's image. Decode
copies only the image's prefix and hands the rest to the CPU (hybrid.share.HostFFN); prefill
and large speculation trees, FLOP-bound where the CPU is slow, copy the whole image and run the
rest on the GPU. The extra RAM is the CPU's packed copy of its units (weights.cpu).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .. import kernels, quant
from ..weights.cpu import kind_for
from ..weights.linear import DenseLinear, QuantLinear

# keep (and ffn - keep) in multiples of this: a K-quant block along down's columns (256), and
# whole 64-row blocks of torch's int4 CPU layout along gate/up's rows
SPLIT_ALIGN = 256
REST_FIELDS = ("ffn_gate_up_rest", "ffn_down_rest")  # the image's tail: decode leaves it out


def split_point(ffn: int, cpu_share: float, align: int = SPLIT_ALIGN) -> int:
    """Intermediate units the GPU keeps for a CPU share in [0, 1] of them, rounded to `align`."""
    if not 0.0 <= cpu_share <= 1.0:
        raise ValueError(f"the CPU share of the FFN must be in [0, 1], not {cpu_share!r}")
    cpu = int(round(ffn * cpu_share / align)) * align
    return max(0, min(ffn, ffn - cpu))


def splittable(qtypes: dict[str, GGMLQuantizationType], ffn: int) -> bool:
    """Whether a layer's FFN can be split: gate and up of one format (one fused GPU linear per
    side), and every FFN matrix in a format a CPU layout reads, with blocks that divide the
    split alignment."""
    gate, up, down = (qtypes[n] for n in ("ffn_gate", "ffn_up", "ffn_down"))
    if gate != up or ffn % SPLIT_ALIGN:
        return False
    for q in (gate, down):
        # not iq: the plan sizes the CPU's share from Q4_K's measured GB/s, and iq's
        # compute-bound kernel reads about a tenth of that (benchmarks/cpu.py kernels)
        if kind_for(q) in (None, "iq") or SPLIT_ALIGN % GGML_QUANT_SIZES[q][0]:
            return False
    return True


def column_slice(raw: torch.Tensor, qtype: GGMLQuantizationType, rows: int, cols: int,
                 c0: int, c1: int) -> torch.Tensor:
    """The GGUF bytes of columns [c0, c1) of a (rows, cols) matrix: whole blocks of each row,
    copied into a contiguous (rows, bytes) tensor on raw's device."""
    block, tsize = GGML_QUANT_SIZES[qtype]
    if c0 % block or c1 % block or not 0 <= c0 < c1 <= cols:
        raise ValueError(f"columns [{c0}, {c1}) of {cols} do not fall on {block}-wide blocks")
    blocks = raw.reshape(rows, cols // block, tsize)
    return blocks[:, c0 // block:c1 // block].reshape(rows, -1).contiguous()


@dataclass
class FFNRaws:
    """One layer's FFN matrices as GGUF bytes: gate and up (ffn, hidden), down (hidden, ffn)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    qtypes: dict[str, GGMLQuantizationType]
    hidden: int
    ffn: int

    def gate_up_rows(self, r0: int, r1: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Rows [r0, r1) of gate and of up (gate's first): the parts of one fused linear."""
        return [self.gate[r0:r1], self.up[r0:r1]], [(r1 - r0, self.hidden)] * 2

    def down_cols(self, c0: int, c1: int) -> torch.Tensor:
        return column_slice(self.down, self.qtypes["ffn_down"], self.hidden, self.ffn, c0, c1)


def ffn_raws(src, cfg, i: int) -> FFNRaws:
    """Layer i's FFN bytes from a TensorSource (weights.loader), on the host."""
    p = f"blk.{i}"
    shapes = {"ffn_gate": (cfg.ffn, cfg.hidden), "ffn_up": (cfg.ffn, cfg.hidden),
              "ffn_down": (cfg.hidden, cfg.ffn)}
    raws = {n: src.raw(f"{p}.{n}.weight", s) for n, s in shapes.items()}
    qtypes = {n: GGMLQuantizationType(int(src.type_of(f"{p}.{n}.weight"))) for n in shapes}
    return FFNRaws(raws["ffn_gate"], raws["ffn_up"], raws["ffn_down"], qtypes, cfg.hidden,
                   cfg.ffn)


def layer_splittable(src, cfg, i: int) -> bool:
    """Whether layer i's FFN can be split (splittable(), and no FFN biases to share out).
    Both shares compute the gated product (SwiGLU or GeGLU) of one RMS-normed input, and
    their down projections' partial sums meet before any post-FFN norm (model.llama.
    _split_ffn): a family whose FFN reads another norm (Cohere 2's LayerNorm, OLMo 2's raw
    input) or runs beside attention (Cohere 2) keeps its layers whole, as does one whose
    layers differ in shape (Gemma 4: the split's buffers and balance are sized for one FFN)."""
    if cfg.parallel or cfg.norm != "rms" or not cfg.pre_norms or not cfg.uniform:
        return False
    if cfg.n_experts:  # a mixture of experts has no one FFN to split (model.moe)
        return False
    p = f"blk.{i}"
    if not src.has(f"{p}.ffn_gate.weight"):  # gate and up stored as one tensor (Phi-3)
        return False
    if any(src.has(f"{p}.{n}.bias") for n in ("ffn_gate", "ffn_up", "ffn_down")):
        return False
    qtypes = {n: GGMLQuantizationType(int(src.type_of(f"{p}.{n}.weight")))
              for n in ("ffn_gate", "ffn_up", "ffn_down")}
    return splittable(qtypes, cfg.ffn)


def split_layer(builder, src, i: int, keep: int):
    """Layer i built by `builder` (weights.loader.LayerBuilder) with its FFN in two shares of
    intermediate units, [0, keep) in ffn_gate_up/ffn_down and the rest in ffn_gate_up_rest/
    ffn_down_rest, each in the builder's format (quantized for the GPU kernels, or dense on a
    CPU device). The layer is the same function of its input as the unsplit one; only the
    order of the down projection's sums differs."""
    cfg = builder.cfg
    if not 0 < keep < cfg.ffn or keep % SPLIT_ALIGN:
        raise ValueError(f"cannot keep {keep} of {cfg.ffn} FFN units on the GPU: 0 < keep < "
                         f"{cfg.ffn}, in multiples of {SPLIT_ALIGN}")
    # the FFN is built here in its two shares only: built whole too, it was packed twice (the
    # FFN is about 80% of a layer's bytes)
    layer = builder.build(src, i, leave_out=frozenset(("ffn_gate_up", "ffn_down")))
    raws = ffn_raws(src, cfg, i)
    dev = builder.device

    def linear(parts, qtype, shape):
        if builder.quantized:
            raw = torch.cat([p.to(dev) for p in parts])
            return QuantLinear(kernels.pack_weight(raw, qtype, *shape), None,
                               builder.workspace, builder.fuse_scales)
        dense = torch.cat([quant.dequantize(p, qtype, (p.shape[0], shape[1])) for p in parts])
        return DenseLinear(dense.to(device=dev, dtype=builder.precision.weight_dtype))

    def gate_up(r0, r1):
        parts, _ = raws.gate_up_rows(r0, r1)
        return linear(parts, raws.qtypes["ffn_gate"], (2 * (r1 - r0), cfg.hidden))

    def down(c0, c1):
        return linear([raws.down_cols(c0, c1)], raws.qtypes["ffn_down"], (cfg.hidden, c1 - c0))

    layer.ffn_gate = layer.ffn_up = None
    layer.ffn_gate_up, layer.ffn_down = gate_up(0, keep), down(0, keep)
    layer.ffn_gate_up_rest, layer.ffn_down_rest = gate_up(keep, cfg.ffn), down(keep, cfg.ffn)
    return layer
