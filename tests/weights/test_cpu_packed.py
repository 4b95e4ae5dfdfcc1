"""weights.cpu: packed CPU linears against gguf-py's dequantizer.

The oracle is `gguf.quants.dequantize` of the same raw bytes, multiplied in float64. Each
layout's error is held to a bound derived from the rounding it introduces (u = 2^-8, bfloat16's
unit roundoff; K the input width):

  int4pack  weights: s and z rounded to bfloat16, so |w' - w| <= u (|q - 8| |s| + |z|) per
            weight; x rounded to bfloat16 (u |x|); float32 accumulation (K 2^-24 sum|w'x'|);
            the output rounded to bfloat16 (u |y|).
  int4pair  Q8_0's q = 16 h + l as two int4 halves: 16 d, d and 8 d rounded to bfloat16, so
            |w' - w| <= u |d| (16 |h| + |l - 8| + 8); the kernel sums 2K products.
  int8pack  weights: requantized per row against a bfloat16 scale s_n <= (1 + 2^-7) max|w_n| /
            127, so |w' - w| <= s_n / 2 (+ 128 2^-24 s_n: w / s_n is divided in float32);
            then x, accumulation and output as above.
  q4vnni    weights exact (float16/float32 scales hold the GGUF values); x quantized to int8 per
            block of 32, |x' - x| <= dx / 2 with dx = max|x_block| / 127 (+ float32's rounding
            of dx and x / dx: the factor 1 + 2^-20); integer sums exact, then per group a
            product and two multiply-adds, a final add: (G + 3) 2^-24 sum (|s u| + |z|) |x'|
            for G = K / 32 groups (tests/weights/test_q4vnni.py holds the kernel to that
            alone, against the same quantized x); no output rounding (float32 out).
  q6vnni    Q6_K's weights exact, x as q4vnni's, per 16 columns (quant_oracle.q6vnni_bound).

so for each output |y - y_ref| <= E = E1 + u (|y_ref| + E1), E1 = sum_k |dw_k| |x_k| +
u sum_k |w'_k x_k| + K 2^-24 sum_k |w'_k x'_k| (int8/int4).
The largest observed fraction of the bound and the max relative error are printed (-s).
"""

from __future__ import annotations

import dataclasses

import gguf.quants
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.model.llama import rms_norm
from slipstream.quant.encode import quantize
from slipstream.synth import SHAPES, random_tensor, write_synth
from slipstream.weights.cpu import (PackedDecodeLinear, kind_for, pack_group, pack_linear,
                                    packed_nbytes, rms_norm_bf16)
from slipstream.weights.cpu.groups import (BF16_UNIT_ROUNDOFF, GroupAffine, bf16_ceil,
                                           bf16_nearest, group_affine)
from slipstream.weights.cpu.kinds import q4vnni_available
from slipstream.weights.cpu.q6vnni import Q6VnniLinear, q6vnni_available
from quant_oracle import q6vnni_bound
from slipstream.weights.cpu.torch_kernels import (Int4PackLinear, Int4PairLinear,
                                                  Int8PackLinear, int4_params, pack_int4)
from slipstream.weights.cpu.vnni import Q4VnniLinear, Q8VnniLinear, q4vnni_params
from slipstream.weights.linear import Linear
from slipstream.weights.loader import raw_tensor

U = BF16_UNIT_ROUNDOFF
F32_U = 2.0 ** -24
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def oracle(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """gguf-py's dequantization of the bytes, as float64 (rows, cols)."""
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()


def mapped_weights(lin: Linear, ga: GroupAffine) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 weights the kernel multiplies by (from the stored bfloat16 parameters), and
    the magnitude of the terms it sums per weight (int4pair sums two: |w_high| + |w_low|)."""
    rows, cols = ga.shape
    if isinstance(lin, Int4PairLinear):
        sz = lin.scale_zeros.double()[:, :rows]  # (2 cols/32, rows, 2): highs, then lows
        g = cols // 32
        q = ga.codes.to(torch.int16)
        high = torch.div(q, 16, rounding_mode="floor")
        halves = []
        for part, u in ((sz[:g], high + 8), (sz[g:], q - 16 * high)):
            u = u.double().view(rows, g, 32)
            halves.append(((u - 8) * part[..., 0].t()[..., None]
                           + part[..., 1].t()[..., None]).view(rows, cols))
        return halves[0] + halves[1], halves[0].abs() + halves[1].abs()
    if isinstance(lin, Int4PackLinear):
        sz = lin.scale_zeros.double()[:, :rows]  # (cols/32, rows, 2)
        u = (ga.codes.to(torch.int16) - ga.lo).double().view(rows, cols // 32, 32)
        w = ((u - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).view(rows, cols)
        return w, w.abs()
    if isinstance(lin, Int8PackLinear):
        w = lin.codes.double() * lin.scales.double()[:, None]
        return w, w.abs()
    return ga.exact(), ga.exact().abs()


def weight_error_bound(lin: Linear, ga: GroupAffine, w: torch.Tensor) -> torch.Tensor:
    """A priori |w' - w| per weight, from the GGUF values only (not from what was stored)."""
    rows, cols = ga.shape
    if isinstance(lin, Int4PairLinear):  # 16 d, d and 8 d each rounded to bfloat16
        q = ga.codes.to(torch.int16)
        high = torch.div(q, 16, rounding_mode="floor")
        terms = (16 * high.abs() + (q - 16 * high - 8).abs() + 8).double()
        return (U * terms.view(rows, cols // 32, 32) * ga.scale.double().abs()[..., None]
                ).view(rows, cols)
    if isinstance(lin, Int4PackLinear):
        s = ga.scale.double()
        z = (ga.lo + 8) * s + (ga.offset.double() if ga.offset is not None else 0)
        q8 = (ga.codes.to(torch.int16) - ga.lo - 8).abs().double().view(rows, cols // 32, 32)
        return (U * (q8 * s.abs()[..., None] + z.abs()[..., None])).view(rows, cols)
    if isinstance(lin, Int8PackLinear):
        step = w.abs().amax(dim=1, keepdim=True) / 127 * (1 + 2 * U)
        return (step / 2 + 128 * F32_U * step).expand(rows, cols)  # + the rounding of w / s
    return torch.zeros(rows, cols, dtype=torch.float64)


def q4vnni_bound(ga: GroupAffine, xd: torch.Tensor, q8: bool = False) -> torch.Tensor:
    """A priori |y - x w^T| of q4vnni/q8vnni (`q8`) for float64 x (m, K): the quantization of
    x to 16 bits (two int8 digits) and the float32 sums (see weights/cpu/vnni.py)."""
    rows, cols = ga.shape
    if q8:  # Q8_0 and Q5_0 (q8vnni): u = q + 128, z = -128 d
        u, s, z = ga.codes.to(torch.int16) + 128, ga.scale, -128 * ga.scale
    else:
        u, s, z = q4vnni_params(ga)
    w = ga.exact()
    terms = ((u.double().view(rows, -1, 32) * s.double()[..., None]).abs()
             + z.double().abs()[..., None]).view(rows, cols)
    top = 32512
    dx = xd.abs().view(xd.shape[0], -1, 32).amax(-1) / top
    dxe = (dx / 2 * (1 + 2.0 ** -20))[..., None].expand(-1, -1, 32).reshape(xd.shape)
    roundings = cols // 32 + 3 + q8  # 8-bit codes x 16 bits: sums past 2^24
    return dxe @ w.abs().t() + roundings * F32_U * ((xd.abs() + dxe) @ terms.t())


def check(lin: Linear, raw: torch.Tensor, qtype: Q, shape, xs: list[torch.Tensor],
          residual: bool = False) -> dict:
    """Assert lin(x) is within the derived bound of the oracle for each x in xs (each called on
    its own: x's rows are the batch); return the error figures.

    For the packed layouts two more things are held, each tighter than the end-to-end bound:
    the weights the layout stores are within the a priori per-weight bound of the oracle's (the
    mapping itself), and the kernel multiplies by exactly those stored weights (up to float32
    accumulation and the bfloat16 rounding of x and of the output: the packing and the nibble
    order). With `residual`, lin(x, residual=r) must be r + lin(x) bit for bit (one float32
    add), and its error from r + x w^T gets that add's rounding on top."""
    w = oracle(raw, qtype)
    assert tuple(w.shape) == tuple(shape)
    assert lin.out_features == shape[0]
    ga = group_affine(raw, qtype, shape)
    g = torch.Generator().manual_seed(11)
    y, res = [], []
    for x in xs:
        yi = lin(x)
        assert yi.shape == (x.shape[0], shape[0]) and yi.dtype == x.dtype and yi.is_contiguous()
        if residual:
            r = torch.randn(x.shape[0], shape[0], generator=g)
            yr = lin(x, residual=r)
            assert yr.shape == yi.shape and yr.dtype == x.dtype
            assert torch.equal(yr, r + yi)
            res.append(r)
            yi = yr
        y.append(yi)
    x, y = torch.cat(xs), torch.cat(y)
    r = torch.cat(res).double() if residual else torch.zeros(1, dtype=torch.float64)
    xd = x.double()
    y_ref = xd @ w.t()
    err = (y.double() - r - y_ref).abs()
    k = shape[1]
    if isinstance(lin, Q4VnniLinear):  # and Q8VnniLinear
        bound = q4vnni_bound(ga, xd, q8=isinstance(lin, Q8VnniLinear))
    elif isinstance(lin, Q6VnniLinear):
        bound = q6vnni_bound(ga, xd)
    else:
        wm, terms = mapped_weights(lin, ga)
        kk = 2 * k if isinstance(lin, Int4PairLinear) else k  # the products the kernel sums
        dw_bound = weight_error_bound(lin, ga, w)
        assert bool(((wm - w).abs() <= dw_bound * (1 + 1e-9)).all()), (
            f"{lin.kind} {qtype.name}: a stored weight is off by "
            f"{((wm - w).abs() / (dw_bound + 1e-30)).max():.3f} of its bound")
        xb = x.to(torch.bfloat16).double()
        y_kernel = xb @ wm.t()
        acc = kk * F32_U * (xb.abs() @ terms.t())
        tight = acc + U * (y_kernel.abs() + acc)
        kerr = (y.double() - r - y_kernel).abs()
        if residual:
            tight = tight + F32_U * (y.double().abs() + tight)
        assert bool((kerr <= tight * (1 + 1e-9) + 1e-30).all()), (
            f"{lin.kind} {qtype.name}: the kernel is off its stored weights by "
            f"{(kerr / (tight + 1e-30)).max():.3f} of the accumulation bound")
        e1 = (xd.abs() @ dw_bound.t() + U * (xd.abs() @ wm.abs().t())
              + kk * F32_U * (xb.abs() @ terms.t()))
        bound = e1 + U * (y_ref.abs() + e1)
    if residual:  # r + y rounded once in float32
        bound = bound + F32_U * (y.double().abs() + bound)
    tiny = 1e-30
    assert bool((err <= bound * (1 + 1e-9) + tiny).all()), (
        f"{lin.kind} {qtype.name} {shape}: error {err.max():.3e} exceeds the bound "
        f"(worst ratio {(err / (bound + tiny)).max():.3f})")
    return {"max_rel": float(err.max() / y_ref.abs().max()),
            "bound_fraction": float((err / (bound + tiny)).max())}


# Every layout each GGUF format maps onto: the 4-bit formats onto int4pack, Q8_0 and Q5_0 onto
# int4pair, Q8_0, Q5_0 and Q6_K onto int8pack (which also takes the 4-bit ones).
MAPPINGS = [(Q.Q4_0, "int4pack"), (Q.Q4_1, "int4pack"), (Q.Q4_K, "int4pack"),
            (Q.Q8_0, "int4pair"), (Q.Q8_0, "int8pack"), (Q.Q6_K, "int8pack"),
            (Q.Q4_1, "int8pack"), (Q.Q4_K, "int8pack"), (Q.Q5_0, "int4pair"),
            (Q.Q5_0, "int8pack")]
if q4vnni_available():  # the native library: int8 activations times the 4-bit codes
    MAPPINGS += [(Q.Q4_0, "q4vnni"), (Q.Q4_1, "q4vnni"), (Q.Q4_K, "q4vnni"),
                 (Q.Q8_0, "q8vnni"), (Q.Q5_0, "q8vnni")]
if q6vnni_available():  # and its VNNI loop: Q6_K's own codes
    MAPPINGS += [(Q.Q6_K, "q6vnni")]
INT4 = kind_for(Q.Q4_K)  # what "auto" packs the 4-bit formats as here: q4vnni or int4pack


def encoded_floats(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> torch.Tensor:
    """Bytes from slipstream's encoders (gguf-py's quantize for the legacy formats) of float
    weights shaped like a trained matrix's: per-row scales, a nonzero mean in some rows (which
    the offset formats' minima must carry) and a few outliers."""
    rows, cols = shape
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w *= rng.uniform(0.3, 3.0, (rows, 1)).astype(np.float32)
    w += np.where(rng.random((rows, 1)) < 0.5, 0.03, 0.0).astype(np.float32)
    hot = rng.random(shape) < 0.002
    w[hot] *= 20
    return torch.from_numpy(quantize(w, qtype)).view(rows, -1)


@pytest.mark.parametrize("source", ["random blocks", "encoded floats"])
@pytest.mark.parametrize("qtype,kind", MAPPINGS, ids=[f"{t.name}-{k}" for t, k in MAPPINGS])
def test_every_mapping_against_the_oracle(qtype, kind, source):
    """Rows 40 (not a multiple of 16: int4's padding) by 512, batches of 1, 4, 8 and 33 rows,
    with and without a residual, against gguf-py's dequantization of the same bytes."""
    rng = np.random.default_rng([int(qtype), len(kind), len(source)])
    shape = (40, 512)
    raw = (torch.from_numpy(random_tensor(qtype, shape, rng, 0.02)).view(shape[0], -1)
           if source == "random blocks" else encoded_floats(qtype, shape, rng))
    lin = pack_linear(raw, qtype, shape, kind=kind)
    assert lin is not None and lin.kind == kind and lin.out_features == shape[0]
    g = torch.Generator().manual_seed(int(qtype))
    xs = [torch.randn(m, shape[1], generator=g) for m in (1, 4, 8, 33)]
    _record(f"{kind} {qtype.name}", check(lin, raw, qtype, shape, xs))
    _record(f"{kind} {qtype.name}", check(lin, raw, qtype, shape, xs, residual=True))


def _layer_tensors(path, layers=(0,)):
    """(name, raw, qtype, shape) of the layer matrices of a GGUF file."""
    gf = GGUFFile(path)
    out = []
    for i in layers:
        for m in MATRICES:
            info = gf.tensors[f"blk.{i}.{m}.weight"]
            out.append((info.name, raw_tensor(gf, info.name, info.shape).clone(),
                        info.ggml_type, tuple(info.shape)))
    gf.close()
    return out


SYNTH = {  # name -> write_synth arguments; files are written on first use
    "tiny-Q4_K_M": ("tiny", "Q4_K_M", {"n_layers": 2}),
    "tiny-Q4_0": ("tiny", "Q4_0", {"n_layers": 1}),
    "tiny-Q8_0": ("tiny", "Q8_0", {"n_layers": 1}),
    # real float data quantized by slipstream's / gguf-py's encoders, not random block fields
    "tiny-Q4_K_M-floats": ("tiny", "Q4_K_M", {"n_layers": 1, "from_floats": True}),
    # the 1B's matrices (2048 x 2048 ... 8192 x 2048), one layer, a small vocabulary
    "1b-Q4_K_M": (dataclasses.replace(SHAPES["1b"], vocab=512, n_layers=1), "Q4_K_M", {}),
}


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu_packed")
    written: dict[str, object] = {}

    class Files:
        def __getitem__(self, name):
            if name not in written:
                shape, mix, kw = SYNTH[name]
                written[name] = write_synth(d / f"{name}.gguf", shape, mix, **kw)
            return written[name]

    return Files()


REPORT: dict[str, dict] = {}


def _record(key: str, fig: dict) -> None:
    r = REPORT.setdefault(key, {"max_rel": 0.0, "bound_fraction": 0.0})
    for k in r:
        r[k] = max(r[k], fig[k])


@pytest.fixture(scope="module", autouse=True)
def _print_report():
    yield
    for key, r in sorted(REPORT.items()):
        print(f"\n{key:28s} max |y - y_ref| / max |y_ref| = {r['max_rel']:.3e}, "
              f"largest fraction of the bound = {r['bound_fraction']:.3f}", end="")


@pytest.mark.parametrize("kind", ["auto", pytest.param("int8pack", marks=pytest.mark.slow)])
@pytest.mark.parametrize("file", ["tiny-Q4_K_M", "tiny-Q4_0", "tiny-Q8_0", "tiny-Q4_K_M-floats",
                                  pytest.param("1b-Q4_K_M", marks=pytest.mark.slow)])
def test_synth_layers_match_the_oracle(synth_files, file, kind):
    g = torch.Generator().manual_seed(1)
    layers = (0, 1) if file == "tiny-Q4_K_M" else (0,)
    for name, raw, qtype, shape in _layer_tensors(synth_files[file], layers):
        lin = pack_linear(raw, qtype, shape, kind=kind)
        assert lin is not None
        xs = [torch.randn(m, shape[1], generator=g) for m in (1, 4, 8)]
        _record(f"{lin.kind} {qtype.name}", check(lin, raw, qtype, shape, xs))


@pytest.mark.parametrize("m", [m if m in (1, 8) else pytest.param(m, marks=pytest.mark.slow)
                               for m in range(1, 9)])
def test_every_batch_size_up_to_8(synth_files, m):
    g = torch.Generator().manual_seed(m)
    tensors = {t[2]: t for t in _layer_tensors(synth_files["tiny-Q4_K_M"])}
    q8 = torch.from_numpy(random_tensor(Q.Q8_0, (40, 512), np.random.default_rng(m), 0.02))
    tensors[Q.Q8_0] = (None, q8.view(40, -1), None, (40, 512))
    for qtype, kinds in ((Q.Q4_K, ("int4pack", INT4, "int8pack")),
                         (Q.Q6_K, tuple({"int8pack", kind_for(Q.Q6_K)})),
                         (Q.Q8_0, ("int4pair", "int8pack"))):
        _, raw, _, shape = tensors[qtype]
        x = torch.randn(m, shape[1], generator=g)
        for kind in kinds:
            check(pack_linear(raw, qtype, shape, kind=kind), raw, qtype, shape, [x])


@pytest.mark.slow
def test_default_model(smollm_path):
    """The default model: Q4_1 layers (q4vnni, or int4pack without the native library) and its
    Q8_0 tied embedding (q8vnni, or int4pair), and both through int8pack."""
    gf = GGUFFile(smollm_path)
    g = torch.Generator().manual_seed(2)
    cases = [f"blk.{i}.{m}.weight" for i in (0, 15, 29) for m in MATRICES]
    cases.append("token_embd.weight")
    seen = set()
    for name in cases:
        info = gf.tensors[name]
        raw = raw_tensor(gf, name, info.shape).clone()
        shape = tuple(info.shape)
        if name == "token_embd.weight":  # 49152 rows: the first 4096 keep the oracle small
            raw, shape = raw[:4096].contiguous(), (4096, shape[1])
        seen.add(info.ggml_type)
        for kind in ("auto", "int8pack"):
            lin = pack_linear(raw, info.ggml_type, shape, kind=kind)
            xs = [torch.randn(m, shape[1], generator=g) for m in (1, 8)]
            _record(f"smollm {lin.kind} {info.ggml_type.name}",
                    check(lin, raw, info.ggml_type, shape, xs))
    gf.close()
    assert seen == {Q.Q4_1, Q.Q8_0}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q6_K])
def test_unpacking_is_the_dequantizer_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = torch.from_numpy(random_tensor(qtype, (48, 512), rng, 0.02)).view(48, -1)
    ga = group_affine(raw, qtype, (48, 512))
    ref = gguf.quants.dequantize(raw.numpy(), qtype)
    assert np.array_equal(ga.dequantize().numpy(), ref)  # float32, same operations
    exact, ref64 = ga.exact(), torch.from_numpy(ref).double()
    if qtype == Q.Q6_K:  # float32 may round a 25-bit d*sc*q once
        assert torch.all((exact - ref64).abs() <= F32_U * ref64.abs())
    else:
        assert torch.equal(exact, ref64)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_mapping_is_exact_before_rounding(qtype):
    """w = (u - 8) s + z reproduces the oracle exactly, and torch's kernel with float32 scales
    and zeros (its slow exact path) multiplies by exactly those weights: the mapping, the
    nibble order and the packing are right, and only the bfloat16 rounding remains."""
    rng = np.random.default_rng(7)
    rows, cols = 64, 256
    raw = torch.from_numpy(random_tensor(qtype, (rows, cols), rng, 0.02)).view(rows, -1)
    u, s, z = int4_params(group_affine(raw, qtype, (rows, cols)))
    w = ((u.double().view(rows, -1, 32) - 8) * s[..., None] + z[..., None]).view(rows, cols)
    assert torch.equal(w, oracle(raw, qtype))
    assert torch.equal(s.float().double(), s) and torch.equal(z.float().double(), z)
    sz = torch.stack([s.float().t(), z.float().t()], dim=-1).contiguous()
    x = torch.randn(3, cols)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack_int4(u), 32, sz)
    ref = x.double() @ w.t()
    assert torch.all((y.double() - ref).abs() <= cols * F32_U * (x.double().abs() @ w.abs().t()))


def test_residual_bias_padding_and_fusion():
    """Rows not a multiple of 16 (padded for int4), biases, the residual, and q/k/v fused into
    one linear of mixed 4-bit formats giving the parts' numbers."""
    rng = np.random.default_rng(3)
    cols = 256
    specs = [(Q.Q4_K, 40), (Q.Q4_0, 24), (Q.Q4_1, 8)]
    raws = [torch.from_numpy(random_tensor(t, (n, cols), rng, 0.02)).view(n, -1)
            for t, n in specs]
    shapes = [(n, cols) for _, n in specs]
    biases = [torch.randn(n) for _, n in specs]
    x = torch.randn(5, cols)
    res = torch.randn(5, sum(n for _, n in specs))
    fused, parts = pack_group(raws, [t for t, _ in specs], shapes, biases)
    assert fused.kind == INT4 and parts == [] and fused.out_features == 72
    y = fused(x, residual=res)
    singles = [pack_linear(r, t, s, b) for r, (t, _), s, b in zip(raws, specs, shapes, biases)]
    assert torch.equal(y, res + torch.cat([p(x) for p in singles], dim=1))
    for p, r, (t, _), s, b in zip(singles, raws, specs, shapes, biases):
        no_bias = pack_linear(r, t, s)
        assert torch.equal(p(x), no_bias(x) + b)
        check(no_bias, r, t, s, [x])
    # Q6_K cannot join int4: separate parts, each in its own layout
    q6 = torch.from_numpy(random_tensor(Q.Q6_K, (16, cols), rng, 0.02)).view(16, -1)
    fused, parts = pack_group([raws[0], q6], [Q.Q4_K, Q.Q6_K], [shapes[0], (16, cols)],
                              [None, None])
    assert fused is None and [p.kind for p in parts] == [INT4, kind_for(Q.Q6_K)]
    # int8 takes both: one linear
    fused, _ = pack_group([raws[0], q6], [Q.Q4_K, Q.Q6_K], [shapes[0], (16, cols)],
                          [None, None], kind="int8pack")
    assert isinstance(fused, Int8PackLinear) and fused.out_features == 56


@pytest.mark.parametrize("qtype,kind", [(Q.Q4_K, "int4pack"), (Q.Q4_K, INT4),
                                        (Q.Q8_0, "int4pair"), (Q.Q8_0, "int8pack")])
def test_packed_kernels_are_batch_invariant(qtype, kind):
    """A row's result does not depend on the other rows of the batch (torch's packed kernels
    reduce each row alone, in the same order): decode, verification trees and prefill agree
    bit for bit."""
    rng = np.random.default_rng(5)
    raw = torch.from_numpy(random_tensor(qtype, (256, 512), rng, 0.02)).view(256, -1)
    lin = pack_linear(raw, qtype, (256, 512), kind=kind)
    x = torch.randn(12, 512)
    full = lin(x)
    for i in range(12):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])


def test_row_slices_give_the_rows():
    """A layer split by output rows (CPU share and GPU share): each slice computes exactly its
    rows of the whole."""
    rng = np.random.default_rng(9)
    rows, cols = 200, 256  # 200: a partial last block, padded to 208 for int4
    for qtype, kind in ((Q.Q4_K, "int4pack"), (Q.Q4_K, INT4), (Q.Q8_0, "int4pair"),
                        (Q.Q6_K, "int8pack"), (Q.Q6_K, kind_for(Q.Q6_K))):
        raw = torch.from_numpy(random_tensor(qtype, (rows, cols), rng, 0.02)).view(rows, -1)
        lin = pack_linear(raw, qtype, (rows, cols), torch.randn(rows), kind=kind)
        assert lin.kind == kind
        x = torch.randn(3, cols)
        y = lin(x)
        for r0, r1 in ((0, 64), (64, 200), (128, 192), (192, 200)):
            part = lin.row_slice(r0, r1)
            assert type(part) is type(lin) and part.out_features == r1 - r0
            assert torch.equal(part(x), y[:, r0:r1])
    lin4 = pack_linear(torch.from_numpy(random_tensor(Q.Q4_K, (rows, cols), rng, 0.02))
                       .view(rows, -1), Q.Q4_K, (rows, cols), kind="int4pack")
    with pytest.raises(ValueError):
        lin4.row_slice(32, 96)  # not on 64-row blocks


def test_linear_protocol_defaults():
    """norm_matmul and glu_matmul come from weights.linear.Linear."""
    rng = np.random.default_rng(4)
    raw = torch.from_numpy(random_tensor(Q.Q4_K, (64, 256), rng, 0.02)).view(64, -1)
    lin = pack_linear(raw, Q.Q4_K, (64, 256))
    assert isinstance(lin, Linear)
    x = torch.randn(2, 256)
    norm = torch.rand(256) + 0.5
    assert torch.equal(lin.norm_matmul(x, norm, 1e-5), lin(rms_norm(x, norm, 1e-5)))
    gu = torch.randn(2, 512)
    g, u = gu.chunk(2, dim=-1)
    assert torch.equal(lin.glu_matmul(gu, residual=torch.ones(2, 64)),
                       lin(F.silu(g) * u, residual=torch.ones(2, 64)))


@pytest.mark.slow
def test_int4_packing_in_slices_is_packing_whole():
    u = torch.randint(0, 16, (1024 + 320, 4096), dtype=torch.uint8)  # 64-row slices
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 1)
    assert torch.equal(pack_int4(u), whole)


def test_bfloat16_rounding():
    v = torch.tensor([1 + 2 ** -8 + 2 ** -30, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.0, 0.0,
                      -(1 + 2 ** -8 + 2 ** -30)], dtype=torch.float64)
    # nearest (ties to even), rounded once: torch's own float64 -> bf16 goes through float32
    assert bf16_nearest(v).double().tolist() == [1 + 2 ** -7, 1.0, 1 + 2 ** -6, 3.0, 0.0,
                                                 -(1 + 2 ** -7)]
    r = torch.rand(10000, dtype=torch.float64) * 10
    b = bf16_nearest(r).double()
    assert torch.all((b - r).abs() <= U * r.abs())
    c = bf16_ceil(r).double()
    assert torch.all(c >= r) and torch.all(c - r <= 2 * U * r)


@pytest.mark.parametrize("kind", ["auto", "int8pack"])
@pytest.mark.parametrize("qtype,rows", [(Q.Q4_K, 40), (Q.Q4_1, 64), (Q.Q8_0, 40), (Q.Q6_K, 16)])
def test_packed_nbytes_is_what_is_built(qtype, rows, kind):
    rng = np.random.default_rng(8)
    raw = torch.from_numpy(random_tensor(qtype, (rows, 512), rng, 0.02)).view(rows, -1)
    lin = pack_linear(raw, qtype, (rows, 512), kind=kind)
    assert packed_nbytes(qtype, (rows, 512), kind) == lin.nbytes


def test_kinds():
    four = "q4vnni" if q4vnni_available() else "int4pack"
    assert kind_for(Q.Q4_K) == four and kind_for(Q.Q4_1) == four and kind_for(Q.Q4_0) == four
    assert kind_for(Q.Q4_K, "int4pack") == "int4pack"
    assert kind_for(Q.Q8_0) == ("q8vnni" if q4vnni_available() else "int4pair")
    assert kind_for(Q.Q8_0, "int4pair") == "int4pair"
    assert kind_for(Q.Q6_K) == ("q6vnni" if q6vnni_available() else "int8pack")
    assert kind_for(Q.Q8_0, "int8pack") == "int8pack"
    assert kind_for(Q.Q6_K, "int4pack") is None
    # Q5_1 and Q5_K: our q8vnni (float32 scales and zeros) alone; no torch kernel reads them
    five = "q8vnni" if q4vnni_available() else None
    assert kind_for(Q.Q5_K) == five and kind_for(Q.Q5_1) == five
    assert kind_for(Q.Q5_K, "torch") is None and kind_for(Q.Q5_1, "int4pair") is None
    assert kind_for(Q.Q4_K, "int4pair") is None and kind_for(Q.Q8_0, "int4pack") is None
    assert kind_for(Q.F16) is None and kind_for(Q.Q3_K) is None
    assert pack_linear(torch.zeros(16, 4 * 110, dtype=torch.uint8), Q.Q3_K, (16, 1024)) is None
    with pytest.raises(ValueError):
        kind_for(Q.Q4_K, "fp8")


# --- the decode path's fused forms (PackedDecodeLinear.norm_matmul / glu_matmul) -------------

def test_rms_norm_bf16_rows_alone_and_near_the_exact_norm():
    """Each row is normed as a call of its own would norm it (a decode token and the same token
    in a verification tree or a short prompt get the same bits), and within two bfloat16
    roundings of the float64 norm (the result's and float32's on the way)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, 576, generator=g) * torch.logspace(-2, 2, 8)[:, None]
    w = torch.rand(576, generator=g) + 0.5
    y = rms_norm_bf16(x, w, 1e-5)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    for i in range(8):
        assert torch.equal(rms_norm_bf16(x[i:i + 1], w, 1e-5)[0], y[i])
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.all((y.double() - ref).abs() <= 2 * U * ref.abs())
    out = torch.empty(1, 576, dtype=torch.bfloat16)
    assert rms_norm_bf16(x[:1], w, 1e-5, out) is out and torch.equal(out, y[:1])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_packed_decode_fused_forms(qtype):
    """norm_matmul and glu_matmul on the packed path: the kernel's bfloat16 product of the
    bfloat16 norm (and of SwiGLU formed in bfloat16), each row as in a call of its own; more
    rows than max_rows go to the dense weight's own forms."""
    from slipstream.weights.linear import DenseLinear

    rng = np.random.default_rng(13)
    rows, cols = 96, 256
    raw = torch.from_numpy(random_tensor(qtype, (rows, cols), rng, 0.02)).view(rows, -1)
    dense = DenseLinear(oracle(raw, qtype).float())
    packed = pack_linear(raw, qtype, (rows, cols))
    lin = PackedDecodeLinear(dense, lambda: packed, max_rows=8)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(8, cols, generator=g)
    norm = torch.rand(cols, generator=g) + 0.5
    with torch.inference_mode():  # the engine's mode; the row buffer made here serves both
        first = lin.norm_matmul(x[:1], norm, 1e-5)
    y = lin.norm_matmul(x, norm, 1e-5)
    assert torch.equal(first, y[:1])
    assert y.dtype == torch.bfloat16 and y.shape == (8, rows)
    assert torch.equal(y, packed.kernel(rms_norm_bf16(x, norm, 1e-5)))
    for i in range(8):
        assert torch.equal(lin.norm_matmul(x[i:i + 1], norm, 1e-5)[0], y[i])
    assert torch.equal(lin.norm_matmul(x[:1], norm, 1e-5), y[:1])  # the row buffer reused
    ref = rms_norm(x, norm, 1e-5).double() @ oracle(raw, qtype).t()
    assert float((y.double() - ref).norm() / ref.norm()) < 0.02
    gu = torch.randn(8, 2 * cols, generator=g).to(torch.bfloat16)
    r = torch.randn(8, rows, generator=g)
    z = lin.glu_matmul(gu, residual=r)
    gate, up = gu.chunk(2, dim=-1)
    assert z.dtype == torch.float32
    assert torch.equal(z, r + packed.kernel(F.silu(gate) * up).float())
    for i in range(8):
        assert torch.equal(lin.glu_matmul(gu[i:i + 1], residual=r[i:i + 1])[0], z[i])
    big = torch.randn(9, cols, generator=g)
    assert torch.equal(lin.norm_matmul(big, norm, 1e-5), dense.norm_matmul(big, norm, 1e-5))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # RoPE pairs adjacent / halves; bias
@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_cpu_decode_block_is_the_general_path(tmp_path, monkeypatch, precision, arch):
    """model.llama's one-token CPU path (_cpu_decode, model.cpu_decode) computes the general
    path's bits: the logits and the keys and values it caches. (Its native ops, on by default,
    agree to float32 rounding instead: tests/model/test_cpu_native.py.)"""
    from helpers import cpu_engine

    from slipstream.model import llama
    from slipstream.model.step import append_step

    monkeypatch.setattr(llama, "CPU_NATIVE", False)

    path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=2, from_floats=True,
                       std=0.1, seed=3, arch=arch)
    runs = []
    for lean in (True, False):
        monkeypatch.setattr(llama, "CPU_DECODE", lean)
        engine = cpu_engine(path, ctx=32, precision=precision)
        assert engine.weights.layers[0].attn_qkv is not None
        engine.forward([3, 17, 99])
        logits = torch.cat([engine.forward([t]) for t in (11, 42, 500, 8)])
        with torch.no_grad():  # outside inference mode, on the same thread's buffers
            engine.run_step(torch.tensor([7]), append_step(engine.length, 1, engine.device))
        runs.append((logits, engine.kv.k[:, :, :7], engine.kv.v[:, :, :7]))
    for lean, general in zip(*runs):
        assert torch.equal(lean, general)
