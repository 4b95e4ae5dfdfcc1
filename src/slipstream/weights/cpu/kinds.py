"""Which CPU layout a GGUF matrix takes (`kind_for`), what it costs in RAM (`packed_nbytes`),
and building it (`pack_linear`, `pack_group`)."""

from __future__ import annotations

from typing import Sequence

import torch
from gguf import GGMLQuantizationType

from ... import envs, native
from ..linear import Linear
from .codebook import CB4_FORMATS, Cb4Linear, cb4_available, cb4_grid, cb4_nbytes
from .iquant import IQ_FORMATS, IqLinear, iq_available, iq_nbytes
from .groups import (INT4_FORMATS, INT4_GROUP, OFFSET8_FORMATS, PAIR_FORMATS, UNPACKED_FORMATS,
                     Q, concat_bias)
from .parts import PartsLinear
from .q6vnni import Q6VnniLinear, q6vnni_available, q6vnni_nbytes
from .torch_kernels import Int4PackLinear, Int4PairLinear, Int8PackLinear
from .vnni import Q4VnniLinear, Q8VnniLinear, q4vnni_parts_nbytes, q8vnni_nbytes

KINDS = ("q4vnni", "q8vnni", "q6vnni", "cb4", "iq", "int4pack", "int4pair", "int8pack")
AUTO_KINDS = ("auto", "torch")  # kind_for's choices among KINDS
# the layouts whose native kernels serve a prefill's many rows as well (PackedDecodeLinear's
# packed_prefill: faster than the dense float32 GEMM on the CPUs measured); torch's own
# kernels widen every code to bfloat16 and lose to the GEMM there
PREFILL_KINDS = ("q4vnni", "q8vnni", "q6vnni")


def packed_prefill_on() -> bool:
    """SLIPSTREAM_PACKED_PREFILL (default on; 0 is the fallback to dense float32 prefill)."""
    return bool(envs.get("SLIPSTREAM_PACKED_PREFILL"))


def prefills_packed(qtypes) -> bool:
    """Whether a linear of these formats (its parts') takes prefill through its packed copy:
    every part's layout in PREFILL_KINDS, unless SLIPSTREAM_PACKED_PREFILL=0."""
    return packed_prefill_on() and all(kind_for(t) in PREFILL_KINDS for t in qtypes)


def q4vnni_available() -> bool:
    """Whether q4vnni can run here: the native library builds (slipstream.native; a first call
    compiles it, ~2 s, then it is cached per machine) and is not turned off (SLIPSTREAM_NATIVE=0,
    or SLIPSTREAM_Q4VNNI=0 for this kind alone: the 4-bit formats then go to int4pack)."""
    return envs.get("SLIPSTREAM_Q4VNNI") and native.library() is not None


def kind_for(qtype: GGMLQuantizationType | int, kind: str = "auto") -> str | None:
    """The layout a tensor of `qtype` gets: `kind` if it can take it ("q4vnni" and "int4pack"
    only for 4-bit formats with groups of 32, "q8vnni" and "int4pair" only for Q8_0), or with
    kind="auto": where the native library is there (q4vnni_available), q4vnni for
    Q4_0/Q4_1/Q4_K and q8vnni for Q8_0; where not, int4pack and int4pair (int8pack's per-row
    requantization costs Q8_0 more than a 0.5% perplexity allowance on the default model;
    int4pair, 0.03%); for Q6_K, q6vnni where the native library has its VNNI loop
    (q6vnni_available), else int8pack (16-wide sub-blocks fit no int4 group); None for
    formats no layout reads (keep DenseLinear for those). kind="torch": auto's choice among
    torch's kernels alone (int4pack, int4pair, int8pack). "q6vnni" only for Q6_K. The codebook
    formats (MXFP4, IQ4_NL, IQ4_XS) take cb4 wherever the native library builds (auto; no
    torch kernel reads them: kind="torch" and the others give None), else stay dense; so do
    the i-quant grid formats IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S, IQ2_XS, IQ2_S and IQ1_M with iq
    (auto or "iq"), and Q5_1 and Q5_K with q8vnni's float32 records (auto or "q8vnni", where
    the native library is there)."""
    qtype = Q(int(qtype))
    if kind not in AUTO_KINDS and kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(AUTO_KINDS + KINDS)}, not {kind!r}")
    if qtype in CB4_FORMATS:
        return "cb4" if kind in ("auto", "cb4") and cb4_available() else None
    if qtype in IQ_FORMATS:
        return "iq" if kind in ("auto", "iq") and iq_available() else None
    if kind in ("cb4", "iq"):
        return None
    if qtype in OFFSET8_FORMATS:  # Q5_1, Q5_K: our kernel's q8vnni only (no torch kernel)
        ours = kind in ("auto", "q8vnni") and q4vnni_available()
        return "q8vnni" if ours else None
    if qtype not in UNPACKED_FORMATS:
        return None
    if kind in AUTO_KINDS:
        ours = kind != "torch" and q4vnni_available()
        if qtype in INT4_FORMATS:
            return "q4vnni" if ours else "int4pack"
        if qtype in PAIR_FORMATS:
            return "q8vnni" if ours else "int4pair"
        if qtype == Q.Q6_K and ours and q6vnni_available():
            return "q6vnni"
        return "int8pack"
    if kind in ("int4pack", "q4vnni") and qtype not in INT4_FORMATS:
        return None
    if kind in ("int4pair", "q8vnni") and qtype not in PAIR_FORMATS:
        return None
    if kind == "q6vnni" and qtype != Q.Q6_K:
        return None
    return kind


_BUILDERS = {"q4vnni": Q4VnniLinear.from_raws, "q8vnni": Q8VnniLinear.from_raws,
             "q6vnni": Q6VnniLinear.from_raws, "cb4": Cb4Linear.from_raws,
             "iq": IqLinear.from_raws,
             "int4pack": Int4PackLinear.from_raws, "int4pair": Int4PairLinear.from_raws,
             "int8pack": Int8PackLinear.from_raws}


def packed_nbytes(qtype: GGMLQuantizationType | int, shape: tuple[int, int],
                  kind: str = "auto") -> int | None:
    """RAM the layout of kind_for(qtype, kind) takes for a (rows, cols) matrix (what `nbytes`
    of the built linear reports), without building it; None where no layout reads qtype. For
    memory planners (a resident CPU layer's bytes)."""
    k = kind_for(qtype, kind)
    if k is None:
        return None
    rows, cols = (int(s) for s in shape)
    if k == "q4vnni":  # float16 scales and zeros hold Q4_0's and Q4_1's exactly, not Q4_K's
        return q4vnni_parts_nbytes((qtype,), rows, cols)
    if k == "q8vnni":
        return q8vnni_nbytes(rows, cols, Q(int(qtype)) in OFFSET8_FORMATS)
    if k == "q6vnni":
        return q6vnni_nbytes(rows, cols)
    if k == "cb4":
        return cb4_nbytes(rows, cols)
    if k == "iq":
        return iq_nbytes(qtype, rows, cols)
    if k in ("int4pack", "int4pair"):
        width = cols if k == "int4pack" else 2 * cols  # int4pair: two nibble planes
        padded = -(-rows // 16) * 16
        return padded * width // 2 + width // INT4_GROUP * padded * 2 * 2
    if k == "int8pack":
        return rows * cols + rows * 2
    q = Q(int(qtype))
    group = 16 if q == Q.Q6_K else 32
    planes = 2 if q in (Q.Q4_1, Q.Q4_K) else 1  # scale, and offset where the format has one
    return rows * cols + rows * (cols // group) * 4 * planes


def pack_linear(raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int],
                bias: torch.Tensor | None = None, kind: str = "auto") -> Linear | None:
    """One GGUF matrix (uint8, rows x row_bytes, on the CPU) as a packed CPU linear, or None
    where no layout reads its format (see kind_for). The bytes are only read (a view of the
    file's memory map, or of a staging buffer about to be reused, will do)."""
    fused, _ = pack_group([raw], [qtype], [shape], [bias], kind)
    return fused


def pack_group(raws: Sequence[torch.Tensor], qtypes: Sequence[GGMLQuantizationType | int],
               shapes: Sequence[tuple[int, int]], biases: Sequence[torch.Tensor | None],
               kind: str = "auto") -> tuple[Linear | None, list[Linear | None]]:
    """The parts of one LinearGroup (q/k/v, gate/up: same input width) as packed CPU linears.

    Where every part gets the same layout (e.g. Q4_K and Q4_0 both go to int4pack), their rows
    are concatenated into one linear, returned as (fused, []). Otherwise (None, parts), with a
    None part where its format has no layout. A single part comes back as (it, [])."""
    kinds = [kind_for(t, kind) for t in qtypes]
    # cb4 stacks parts of one grid only (MXFP4's, or IQ4_NL's and IQ4_XS's), iq of one format
    one_grid = (kinds[0] != "cb4" or len({cb4_grid(t) for t in qtypes}) == 1) and \
        (kinds[0] != "iq" or len({int(t) for t in qtypes}) == 1)
    if kinds[0] is not None and len(set(kinds)) == 1 and one_grid:
        return _BUILDERS[kinds[0]](raws, qtypes, shapes, concat_bias(biases, shapes)), []
    parts = [_BUILDERS[k]([r], [t], [s], b) if k is not None else None
             for r, t, s, k, b in zip(raws, qtypes, shapes, kinds, biases)]
    return None, parts


def pack_joined(raws: Sequence[torch.Tensor], qtypes: Sequence[GGMLQuantizationType | int],
                shapes: Sequence[tuple[int, int]], biases: Sequence[torch.Tensor | None]
                ) -> Linear | None:
    """A group's one packed decode linear: pack_group's fused one, or where its parts take
    different layouts (Q4_K_M's q/k/v: Q4_K q and k, Q6_K v) a PartsLinear over them; None
    where a part has no layout (the group then decodes dense)."""
    fused, parts = pack_group(raws, qtypes, shapes, biases)
    if fused is not None:
        return fused
    return PartsLinear(parts) if parts and all(p is not None for p in parts) else None
