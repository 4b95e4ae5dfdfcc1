"""Load-time checks of what a GGUF's tensors hold, past the layout modelfile.validate checks:
tensor names the model does not use, and values no trained model has.

Names. A tensor slipstream does not read is reported in one warning line. A renamed tensor
that the model reads only where the file has it (`output.weight`, whose absence ties the head
to the token embedding; the QKV biases; Llama 3's `rope_freqs.weight`) would otherwise make
the model run without it, so its absence beside an unused tensor of its shape or a near name,
or a bias some layers have and others lack, is a MisnamedTensor.

Values. Every f16 block scale of the quantized weights a load reads, and every element of the
norms and biases, must be finite and within a bound (CorruptTensorValues names the tensor, the
block or element and the value). The scales are read as a strided view of the file's bytes: 2
bytes of every 18-210, but every cache line, so the check costs about a pass over the resident
weights' bytes, which the load reads anyway: on one core of an idle 2-core machine, 11 ms for
the default model's 98 MB (Q4_1: two scales per 20 bytes; its whole load takes 0.4 s) and
0.07 s per GB of a synthetic Q4_K_M file (522 MB); 2-4 times that on a busy one. A streamed layer's weights are read per token, not at load:
only its norms and biases are checked (a few KiB a layer), not its scales, which would read
the whole file (2 ms for the default model's 30 layers).

SLIPSTREAM_CHECK_WEIGHTS=0 turns both errors into TensorWarning and loads the file anyway.
The tensors that passed are recorded next to the model (weights.checked), and a later load of
the unchanged file reads only those it has not checked.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Collection, Iterable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .. import envs, quant
from . import checked
from ..errors import CorruptTensorValues, MisnamedTensor, TensorWarning
from ..model.families import family_for, spec_for
from ..model.layer_spec import EMBEDDING, HEAD
from ..modelfile.config import ModelConfig
from ..modelfile.gguf_file import GGUFFile
from ..modelfile.validate import FIX

ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's divisor pairs (Phi-3), read wherever a file holds them (weights.loader)
LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
OUTPUT_NORM = "output_norm.weight"
ANYWAY = "SLIPSTREAM_CHECK_WEIGHTS=0 loads it anyway"

F16_MAX = 65504.0
# A block scale (d, dmin, m) past this is absurd in any format. Trained models' stay far below
# it: the default model's (SmolLM2-135M, Q4_1/Q8_0) largest is 9.25 (a Q4_1 block minimum,
# its weights reach about ±10) and its largest d 0.77; the synthetic Q4_K/Q6_K files' (std
# 0.02 weights) are below 1e-3.
SCALE_LIMIT = 1024.0
# RMSNorm weights: a normed element reaches sqrt(hidden) (64 at hidden 4096), so a weight past
# 1e4 can take it beyond float16's 65504, where the CPU's float16 GEMMs at precision "fast"
# make it inf. The default model's largest is 3.34 (output_norm), the synthetic files' 1.2.
NORM_LIMIT = 1e4
# A bias is added to q, k and v as it is, and k and v go to CUDA's float16 KV cache: past
# 65504 they are inf there.
BIAS_LIMIT = F16_MAX

# Where each quantized format keeps its f16 scales in a block (ggml-common.h's block_* structs,
# as quant.legacy and quant.kquants read them) and the largest factor a scale is multiplied by
# in one dequantized element: Q4_0 d*q with q in -8..7; Q4_K d*sc*q with sc 0..63, q 0..15;
# Q6_K d*sc*q with sc -128..127, q -32..31; an offset (m, dmin*m) by m's largest. A scale whose
# product can pass 65504 makes float16 weights inf (the CPU's dense weights at "fast").
# (type: ((byte offset, factor, field name), ...))
SCALE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, int, str], ...]] = {
    GGMLQuantizationType.Q4_0: ((0, 8, "d"),),
    GGMLQuantizationType.Q4_1: ((0, 15, "d"), (2, 1, "m")),
    GGMLQuantizationType.Q5_0: ((0, 16, "d"),),
    GGMLQuantizationType.Q5_1: ((0, 31, "d"), (2, 1, "m")),
    GGMLQuantizationType.Q8_0: ((0, 128, "d"),),
    GGMLQuantizationType.Q2_K: ((80, 15 * 3, "d"), (82, 15, "dmin")),
    GGMLQuantizationType.Q3_K: ((108, 32 * 4, "d"),),
    GGMLQuantizationType.Q4_K: ((0, 63 * 15, "d"), (2, 63, "dmin")),
    GGMLQuantizationType.Q5_K: ((0, 63 * 31, "d"), (2, 63, "dmin")),
    GGMLQuantizationType.Q6_K: ((208, 128 * 32, "d"),),
    # the i-quant grids (quant.iquants): d * (0.5 + 15) / 4 by a grid value up to 43 (IQ2),
    # d * (0.5 + 15) / 2 by up to 62 (IQ3_XXS), d * (1 + 2 * 15) by up to 15 (IQ3_S),
    # d * (1 + 2 * 7) by 1 + 1/8 (IQ1_S). IQ1_M spreads its d over four bytes' top nibbles:
    # no field to read here.
    GGMLQuantizationType.IQ2_XXS: ((0, 167, "d"),),
    GGMLQuantizationType.IQ2_XS: ((0, 167, "d"),),
    GGMLQuantizationType.IQ2_S: ((0, 167, "d"),),
    GGMLQuantizationType.IQ3_XXS: ((0, 481, "d"),),
    GGMLQuantizationType.IQ3_S: ((0, 465, "d"),),
    GGMLQuantizationType.IQ1_S: ((0, 17, "d"),),
}
_CHUNK_BLOCKS = 1 << 20  # blocks per pass: bounds the temporaries at 2 MiB whatever the tensor


def scale_limit(factor: int) -> float:
    """The bound on a scale multiplied by up to `factor`: SCALE_LIMIT, or lower where the
    scale alone could take an element past float16's range."""
    return min(SCALE_LIMIT, F16_MAX / factor)


def _f16_bits_at_most(limit: float) -> int:
    """The bits of the largest float16 <= limit: |x| > limit iff (bits(x) & 0x7fff) > this,
    for finite x, and NaN and inf (0x7c00 and up) are above it."""
    h = np.float16(limit)
    bits = int(np.array(h).view(np.uint16))
    return bits - 1 if float(h) > limit else bits


def scale_outlier(data: np.ndarray, qtype: GGMLQuantizationType
                  ) -> tuple[str, int, float, float] | None:
    """The first block of a tensor's bytes `data` (uint8) whose scale is non-finite or past its
    bound: (field, block index, value, bound); None if all are within (or the type has none)."""
    fields = SCALE_FIELDS.get(qtype)
    if not fields:
        return None
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    for offset, factor, field in fields:
        limit = scale_limit(factor)
        most = _f16_bits_at_most(limit)
        for at in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            # (n, 2) bytes with a dense last axis: numpy views them as (n, 1) uint16 in place.
            # One field at a time: a (n, 2) view of d and dmin together took 6x as long
            bits = blocks[at:at + _CHUNK_BLOCKS, offset:offset + 2].view(np.uint16)[:, 0]
            mag = bits & 0x7FFF
            if int(mag.max()) > most:
                i = int(np.argmax(mag > most))
                value = float(np.array(bits[i]).view(np.float16))
                return field, at + i, value, limit
    return None


def vector_outlier(values: np.ndarray, limit: float) -> tuple[int, float] | None:
    """The first element of `values` that is non-finite or past ±limit: (index, value)."""
    v = values.reshape(-1)
    top = np.abs(v).max() if v.size else 0.0
    if top <= limit:  # False for NaN, which max() propagates
        return None
    i = int(np.argmax(~np.isfinite(v) | (np.abs(v) > limit)))
    return i, float(v[i])


def _vector(gf: GGUFFile, name: str) -> np.ndarray:
    """A norm's or bias's values as float32 (numpy: one of these is a few KiB, and a torch
    call on it costs more than the work)."""
    info = gf.tensors[name]
    data = np.asarray(gf.tensor_bytes(name))
    if info.ggml_type == GGMLQuantizationType.F32:
        return data.view(np.float32)
    if info.ggml_type == GGMLQuantizationType.F16:
        return data.view(np.float16).astype(np.float32)
    with warnings.catch_warnings():
        # the map is read-only and torch warns about that; nothing writes through it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return quant.dequantize(raw, info.ggml_type, info.shape).numpy()


def strict() -> bool:
    """Whether a finding refuses the file (the default) or is only a warning."""
    return bool(envs.get("SLIPSTREAM_CHECK_WEIGHTS"))


def tensor_finding(gf: GGUFFile, name: str, kind: str) -> str | None:
    """What is wrong with tensor `name`'s values, or None: a "weight"'s block scales, a
    "norm"'s or "bias"'s elements."""
    info = gf.tensors[name]
    desc = f"{gf.path.name}: tensor {name!r} ({info.ggml_type.name}, shape {list(info.shape)})"
    if kind != "weight":
        limit = NORM_LIMIT if kind == "norm" else BIAS_LIMIT
        hit = vector_outlier(_vector(gf, name), limit)
        if hit is None:
            return None
        i, value = hit
        why = "is not finite" if not np.isfinite(value) else f"is beyond ±{limit:g}"
        return f"{desc} has {kind} value {value:.6g} at element {i}, which {why}"
    found = scale_outlier(np.asarray(gf.tensor_bytes(name)), info.ggml_type)
    if found is None:
        return None
    field, block, value, limit = found
    size = GGML_QUANT_SIZES[info.ggml_type][0]
    per_row = info.shape[-1] // size
    col = block % per_row * size
    why = ("is not finite" if not np.isfinite(value) else
           f"is beyond ±{limit:g}, where no trained model's {info.ggml_type.name} scales reach")
    return (f"{desc} has block scale {field} = {value:.6g} in block {block} (row "
            f"{block // per_row}, columns {col}..{col + size - 1}), which {why}")


def value_findings(gf: GGUFFile, names: list[str], kinds: dict[str, str],
                   first_only: bool) -> list[str]:
    """Messages for the tensors of `names` whose values are non-finite or absurd, in their
    order (the first alone with `first_only`); `kinds` says which are norms and biases (the
    others' block scales are read)."""
    out: list[str] = []
    for name in names:
        found = tensor_finding(gf, name, kinds.get(name, "weight"))
        if found is not None:
            out.append(found)
            if first_only:
                break
    return out


def check_values(gf: GGUFFile, cfg: ModelConfig, resident_layers: Collection[int] | None,
                 embedding: bool, head: bool, experts: bool = True) -> None:
    """The values of what a load reads: the embedding's and head's scales where held, the
    final norm, each layer's norms and biases, and the resident layers' weight scales
    (`resident_layers` None: every layer). CorruptTensorValues at the first bad tensor, or
    one TensorWarning for all of them when SLIPSTREAM_CHECK_WEIGHTS=0.

    experts=False: a mixture of experts' 3-D expert tensors are left out, as a streamed
    layer's weights are (placed expert by expert, most of them stay in the file, and reading
    all of them here would read the whole model at every load)."""
    spec = spec_for(cfg.architecture, cfg.n_experts)
    skipped = set()
    if not experts and spec.experts is not None:
        e = spec.experts
        skipped = {f"{p}.weight" for p in (e.gate, e.up, e.gate_up, e.down)}
    names: list[str] = []
    kinds: dict[str, str] = {OUTPUT_NORM: "norm"}
    if embedding:
        names.append(EMBEDDING)
    if head and HEAD in gf.tensors:
        names.append(HEAD)
    elif head and not embedding:
        names.append(EMBEDDING)  # the head is the tied embedding
    names.append(OUTPUT_NORM)
    for i in range(cfg.n_layers):
        resident = resident_layers is None or i in resident_layers
        for t in spec.tensors:
            name = f"blk.{i}.{t.suffix}"
            if name not in gf.tensors or (t.kind == "weight" and not resident) or \
                    t.suffix in skipped:
                continue
            names.append(name)
            if t.kind != "weight":
                kinds[name] = t.kind
    is_strict = strict()
    done = checked.passed(gf.path)  # an earlier load of the unchanged file checked these
    todo = [n for n in names if n not in done]
    found = value_findings(gf, todo, kinds, first_only=is_strict)
    if not found:
        checked.record(gf.path, todo)
        return
    if is_strict:
        raise CorruptTensorValues(f"{found[0]}; {FIX} ({ANYWAY})")
    more = f" (and {len(found) - 1} more tensors)" if len(found) > 1 else ""
    warnings.warn(f"{found[0]}{more}; loaded anyway (SLIPSTREAM_CHECK_WEIGHTS=0)",
                  TensorWarning, stacklevel=3)


# -- names ------------------------------------------------------------------------------------

NEAR = 0.85  # difflib ratio of a near name: 'output.weigh' 0.96, 'output.bias' 0.67 (no)
SHOWN = 5  # unused tensors named in the warning line
_COMPARED = 64  # unused tensors compared with the missing ones' names


def used_tensors(gf: GGUFFile, cfg: ModelConfig) -> set[str]:
    """The file's tensors a load reads, and those of the multi-token-prediction layers it
    skips by design (cfg.nextn_layers: no warning for them)."""
    used = {EMBEDDING, OUTPUT_NORM, HEAD, ROPE_FREQS, *LONGROPE_FACTORS,
            *family_for(cfg.architecture).top_tensors(cfg)}
    for suffix in spec_for(cfg.architecture, cfg.n_experts).shapes(cfg):
        used.update(f"blk.{i}.{suffix}" for i in range(cfg.n_layers))
    skipped = tuple(f"blk.{i}." for i in range(cfg.n_layers, cfg.n_layers + cfg.nextn_layers))
    if skipped:
        used.update(n for n in gf.tensors if n.startswith(skipped))
    return used & gf.tensors.keys()


def _near(name: str, candidates: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=NEAR)
    return found[0] if found else None


# what a model runs without where the optional tensors of a ModelConfig flag are absent
_WITHOUT = {"attn_bias": "run without its attention biases",
            "qk_norm": "run without its query/key norms",
            "selection_bias": "choose its experts without the selection bias",
            "expert_scale": "weigh its experts without their scales"}


def _misnamed(gf: GGUFFile, cfg: ModelConfig, unused: list[str]) -> str | None:
    """Why the file looks like it renamed a tensor the model reads only where present, or
    None: a bias some layers have and others lack; no `output.weight` beside an unused tensor
    of its shape or a near name; no biases (or no `rope_freqs.weight`) beside an unused tensor
    of a near name."""
    spec = spec_for(cfg.architecture, cfg.n_experts)
    file = gf.path.name
    for flag in sorted({t.flag for t in spec.tensors if t.flag}):
        group = [t for t in spec.tensors if t.flag == flag]
        # (in the layers that hold them: a dense layer has no experts' selection bias)
        names = [f"blk.{i}.{t.suffix}" for i in range(cfg.n_layers) for t in group
                 if t.held(cfg.layer(i))]
        have = [n for n in names if n in gf.tensors]
        if have and len(have) < len(names):
            missing = next(n for n in names if n not in gf.tensors)
            near = _near(missing, unused)
            hint = f"; the unused tensor {near!r} looks like it, renamed" if near else ""
            return (f"{file}: tensor {missing!r} is missing while {len(have)} of the "
                    f"{len(names)} {'/'.join(t.suffix for t in group)} tensors are "
                    f"present{hint}: the layers "
                    f"without it would run without that bias")
    missing: dict[str, str] = {}  # a tensor read where present -> what its absence does
    if HEAD not in gf.tensors:
        shape = (cfg.vocab_size, cfg.hidden)
        same = [u for u in unused if tuple(gf.tensors[u].shape) == shape]
        if same:
            return (f"{file}: the file has no {HEAD!r} but holds the unused tensor {same[0]!r} "
                    f"of its shape {list(shape)}: a renamed head, and the model would run the "
                    f"tied token embedding as its head instead")
        missing[HEAD] = "run the tied token embedding as its head"
    if ROPE_FREQS not in gf.tensors:
        missing[ROPE_FREQS] = "rotate without Llama 3's RoPE frequency divisors"
    for t in spec.tensors:
        if t.flag and not getattr(cfg, t.flag):
            missing.update({f"blk.{i}.{t.suffix}": _WITHOUT.get(t.flag, f"run without {t.flag}")
                            for i in range(cfg.n_layers) if t.held(cfg.layer(i))})
    # (a file of another architecture may hold thousands of unused tensors: a few hundred
    # comparisons each would take seconds, and the first names tell already)
    for u in unused[:_COMPARED]:
        match = _near(u, missing)
        if match is not None:
            return (f"{file}: the file has no {match!r} but holds the unused tensor {u!r}, a "
                    f"near name: a renamed tensor, and the model would {missing[match]}")
    return None


def check_tensor_names(gf: GGUFFile, cfg: ModelConfig) -> None:
    """Renamed tensors (MisnamedTensor, a TensorWarning when SLIPSTREAM_CHECK_WEIGHTS=0), then
    one TensorWarning line for the tensors the load does not read."""
    used = used_tensors(gf, cfg)
    unused = [n for n in gf.tensors if n not in used]
    why = _misnamed(gf, cfg, unused)
    if why is not None:
        if strict():
            raise MisnamedTensor(f"{why}; {FIX} ({ANYWAY})")
        warnings.warn(f"{why}; loaded anyway (SLIPSTREAM_CHECK_WEIGHTS=0)", TensorWarning,
                      stacklevel=3)
    if unused:
        shown = ", ".join(repr(n) for n in unused[:SHOWN])
        more = f" and {len(unused) - SHOWN} more" if len(unused) > SHOWN else ""
        warnings.warn(f"{gf.path.name}: {len(unused)} tensor(s) the model does not use, "
                      f"ignored: {shown}{more}; a renamed tensor would show here", TensorWarning,
                      stacklevel=3)
