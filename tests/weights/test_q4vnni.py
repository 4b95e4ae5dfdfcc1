"""weights.cpu_packed.Q4VnniLinear, Q8VnniLinear and native/q4_matvec.c: 4-bit (and Q8_0's
8-bit) weights times int8 activations.

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (int8 codes q and per-32 scales dx from `ss_q8_quantize_row`, themselves
checked against a torch reimplementation; or the 16-bit X = 256 hi + lo of
`ss_q16_quantize_row`), summed in float64. The kernel's sums of code
products are exact integers, so what it may differ by is its float32 roundings alone: per group
one product (isum * dx), one multiply-add into the scale term and one into the zero term (whose
dx * sum(q) is rounded once too), then one final add. For G groups that is at most
(G + 3) 2^-24 sum_k (|s_g u_k| + |z_g|) |dx q_k| per output (first-order), which each test holds
every output to.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
import gguf.quants

from slipstream import native
from slipstream.weights import cpu_packed
from slipstream.weights.cpu_packed import (Q4VnniLinear, Q8VnniLinear, group_affine, kind_for,
                                           pack_linear, packed_nbytes)
from quant_oracle import (assert_chunked_threads_give_the_bits, assert_same_bits_every_way,
                          assert_within_bound, make_raw, quantize_rows, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

# (format, rows, cols): odd row counts (the last 16-row block padded), and widths that are not
# a multiple of 256 where the format allows it (Q4_0, Q4_1: blocks of 32; Q4_K: 256)
SHAPES = [(Q.Q4_0, 37, 96), (Q.Q4_0, 16, 32), (Q.Q4_1, 45, 160), (Q.Q4_1, 64, 576),
          (Q.Q4_K, 23, 256), (Q.Q4_K, 80, 768), (Q.Q8_0, 29, 96), (Q.Q8_0, 48, 576)]
KIND = {Q.Q4_0: "q4vnni", Q.Q4_1: "q4vnni", Q.Q4_K: "q4vnni", Q.Q8_0: "q8vnni"}
IDS = [f"{t.name}-{r}x{c}" for t, r, c in SHAPES]


def affine(raw: torch.Tensor, qtype: Q, shape):
    """(u, s, z) with w = s u + z: the kernel's unsigned codes and per-group scale and zero."""
    ga = group_affine(raw, qtype, shape)
    if qtype == Q.Q8_0:
        return ga.codes.to(torch.int16) + 128, ga.scale, -128 * ga.scale
    return cpu_packed._q4vnni_params(ga)


def oracle(raw: torch.Tensor, qtype: Q, shape, x: torch.Tensor, bits: int = 8):
    """(float64 y of the dequantized weights times the quantized x, the rounding bound per
    output), x float32 (m, k). Per group: a product, two multiply-adds (and for Q8_0's codes
    times 16-bit X, whose sums pass 2^24, the sum's conversion to float); then one add."""
    rows, cols = shape
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    xq = quantized(x, bits)
    u, s, z = affine(raw, qtype, shape)
    terms = ((u.double().view(rows, -1, 32) * s.double()[..., None]).abs()
             + z.double().abs()[..., None]).view(rows, cols)
    roundings = cols // 32 + 3 + (qtype == Q.Q8_0 and bits == 16)
    return xq @ w.t(), roundings * F32_U * (xq.abs() @ terms.t())


def test_quantizer_matches_torch():
    """dx = max|x| / 127 in float32, q = round-half-even(x / dx) clamped to 127, sx = dx sum(q);
    an all-zero block gives zeros; halves round to even."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    x[1, 32:64] = 0.0  # a zero block
    x[2, 64:96] = torch.arange(32) - 15.5  # halves, and with max |x| = 127 dx = 1 exactly:
    x[2, 64] = -127.0  # so x / dx hits exact halves
    q, dx, sx = quantize_rows(x)
    blocks = x.view(3, -1, 32)
    d_ref = blocks.abs().amax(-1) / 127.0
    safe = torch.where(d_ref == 0, torch.ones_like(d_ref), d_ref)
    q_ref = torch.round(blocks / safe[..., None]).clamp(-127, 127)
    q_ref = torch.where(d_ref[..., None] == 0, torch.zeros_like(q_ref), q_ref).to(torch.int8)
    assert torch.equal(dx, d_ref)
    assert torch.equal(q.view(3, -1, 32), q_ref)
    assert torch.equal(sx, d_ref * q_ref.sum(-1).float())
    assert torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8)) and dx[1, 1] == 0


# Q4_K packs either way: its own scales (Q4_KS, the default) or the float32 records
LAYOUTS = [(t, r, c, False) for t, r, c in SHAPES] + [
    (t, r, c, True) for t, r, c in SHAPES if t == Q.Q4_K]
LAYOUT_IDS = [f"{t.name}-{r}x{c}" + ("-ks" if ks else "") for t, r, c, ks in LAYOUTS]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype,rows,cols,k_scales", LAYOUTS, ids=LAYOUT_IDS)
def test_kernel_against_the_oracle(qtype, rows, cols, k_scales, threads, bits, monkeypatch):
    """float32 in and out, 1 to 9 activation rows (passes of 4 in the C), both loops, 8- and
    16-bit activations."""
    monkeypatch.setattr(cpu_packed, "Q4VNNI_KS", k_scales)  # SLIPSTREAM_Q4VNNI_KS
    raw = make_raw(qtype, rows, cols, 1)
    lin = pack_linear(raw, qtype, (rows, cols), kind=KIND[qtype])
    assert isinstance(lin, Q4VnniLinear) and lin.out_features == rows
    assert lin.kind == KIND[qtype]
    assert lin.nbytes == packed_nbytes(qtype, (rows, cols), kind=KIND[qtype])
    assert lin.k_scales == k_scales
    # Q4_0/Q4_1/Q8_0's fields are float16s; Q4_K's float32 records or its own scales
    assert lin.scale_f32 == (qtype == Q.Q4_K and not k_scales)
    g = torch.Generator().manual_seed(rows)
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        x[0, :32] *= 50  # one block far larger than the rest
        y_ref, bound = oracle(raw, qtype, (rows, cols), x, bits)
        for generic in (False, True):
            y = lin.matvec(x, torch.empty(m, rows), threads=threads, generic=generic,
                           act_bits=bits)
            assert_within_bound(y, y_ref, bound, f"{qtype.name} m={m} generic={generic}")


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_16_bit_activations_lose_less_than_bfloat16(qtype, rows, cols):
    """Against the exact x (not its quantization): int8 activations err by ~0.5% of the output,
    more than rounding x to bfloat16 does; 16 bits, far less than that."""
    raw = make_raw(qtype, rows, cols, 10)
    lin = pack_linear(raw, qtype, (rows, cols), kind=KIND[qtype])
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(10))
    y_ref = x.double() @ w.t()

    def rel(y):
        return float((y.double() - y_ref).norm() / y_ref.norm())

    bf16 = rel(x.to(torch.bfloat16).double() @ w.t())
    one = rel(lin.matvec(x, torch.empty(4, rows), act_bits=8))
    two = rel(lin.matvec(x, torch.empty(4, rows), act_bits=16))
    assert 1e-3 < one < 2e-2 and two < bf16 / 20, (one, two, bf16)


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_vnni_and_plain_c_agree_bit_for_bit(qtype, rows, cols):
    """The same float operations in the same order in both loops, any thread count, and a row's
    bits whatever else shares its call."""
    raw = make_raw(qtype, rows, cols, 2)
    lin = pack_linear(raw, qtype, (rows, cols), kind=KIND[qtype])
    assert_same_bits_every_way(lin, torch.randn(6, cols,
                                                generator=torch.Generator().manual_seed(3)),
                               rows)


def test_has_vnni_where_the_cpu_does():
    """-march=native turns the VNNI loop on wherever the CPU has it, and the AVX2 loop where it
    has AVX2 alone (else the tests above ran the plain-C loop twice)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if " avx512_vnni" in flags and " avx512bw" in flags:
        assert native.library().ss_q4_has_vnni() == 1
    if " avx2" in flags and " fma" in flags and " f16c" in flags:
        # the AVX2 loop where VNNI is missing (else 2-core AVX2 machines decode at ~11 tok/s)
        assert native.library().ss_q4_has_simd() == 1


def test_bfloat16_input_and_output():
    """kernel(): bfloat16 rows in (widened exactly), bfloat16 out = the float32 result rounded
    to nearest even, as torch rounds."""
    raw = make_raw(Q.Q4_1, 45, 160, 4)
    lin = pack_linear(raw, Q.Q4_1, (45, 160), kind="q4vnni")
    xb = torch.randn(2, 160, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y32 = lin.matvec(xb.float(), torch.empty(2, 45))
    assert torch.equal(lin.matvec(xb, torch.empty(2, 45)), y32)
    yb = lin.kernel(xb)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 45)
    assert torch.equal(yb, y32.to(torch.bfloat16))


def test_linear_call_bias_residual_and_row_slice():
    """__call__ in float32 (plus bias, residual), row_slice shares the packed bytes."""
    rows, cols = 48, 96
    raw = make_raw(Q.Q4_0, rows, cols, 5)
    bias = torch.randn(rows)
    lin = cpu_packed.pack_group([raw], [Q.Q4_0], [(rows, cols)], [bias], kind="q4vnni")[0]
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    r = torch.randn(3, rows)
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, lin.matvec(x, torch.empty(3, rows)) + bias)
    assert torch.equal(lin(x, residual=r), r + y)
    part = lin.row_slice(16, 48)
    assert part.packed.data_ptr() == lin.packed[1:].data_ptr()
    assert torch.equal(part(x), y[:, 16:48])
    with pytest.raises(ValueError):
        lin.row_slice(8, 48)


def test_packing_layout():
    """Chunk j % 4 of a group record, bytes 4r..4r+3: row r's columns 4j..4j+3, low nibbles for
    j < 4; then 16 scales and 16 zeros."""
    rows, cols = 16, 64
    raw = make_raw(Q.Q4_1, rows, cols, 6)
    lin = pack_linear(raw, Q.Q4_1, (rows, cols), kind="q4vnni")
    ga = group_affine(raw, Q.Q4_1, (rows, cols))
    p = lin.packed[0]  # (groups, 320)
    for g in range(2):
        for j in range(8):
            chunk = p[g, 64 * (j % 4):64 * (j % 4 + 1)].view(16, 4).to(torch.int16)
            codes = (chunk >> 4) if j >= 4 else (chunk & 15)
            want = ga.codes[:, 32 * g + 4 * j:32 * g + 4 * j + 4].to(torch.int16)
            assert torch.equal(codes, want)
        s = p[g, 256:288].view(torch.float16).float()
        z = p[g, 288:320].view(torch.float16).float()
        assert torch.equal(s, ga.scale[:, g]) and torch.equal(z, ga.offset[:, g])


@pytest.mark.parametrize("rows,cols", [(23, 256), (80, 768)])
def test_q4k_own_scales_give_the_float32_records_bits(rows, cols, monkeypatch):
    """Q4_K packed with its own scales (4.625 bits a weight) gives the bits of the float32
    records (6 bits), in both loops, for 8- and 16-bit activations: d sc and -dmin mn are the
    same exact products either way."""
    raw = make_raw(Q.Q4_K, rows, cols, 11)
    monkeypatch.setattr(cpu_packed, "Q4VNNI_KS", False)  # SLIPSTREAM_Q4VNNI_KS=0
    f32 = pack_linear(raw, Q.Q4_K, (rows, cols), kind="q4vnni")
    assert f32.nbytes == packed_nbytes(Q.Q4_K, (rows, cols), kind="q4vnni")
    monkeypatch.setattr(cpu_packed, "Q4VNNI_KS", True)  # SLIPSTREAM_Q4VNNI_KS=1
    own = pack_linear(raw, Q.Q4_K, (rows, cols), kind="q4vnni")
    assert own.k_scales and f32.scale_f32 and not f32.k_scales
    assert own.nbytes * 8 == -(-rows // 16) * 16 * cols * 4.625
    assert f32.nbytes * 8 == -(-rows // 16) * 16 * cols * 6
    assert own.nbytes == packed_nbytes(Q.Q4_K, (rows, cols), kind="q4vnni")
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(12))
    x[1, 64:96] *= -40
    for generic in (False, True):
        for bits in (8, 16):
            a = own.matvec(x, torch.empty(5, rows), generic=generic, act_bits=bits)
            b = f32.matvec(x, torch.empty(5, rows), generic=generic, act_bits=bits)
            assert torch.equal(a, b), (generic, bits)


def test_q4k_own_scales_layout(monkeypatch):
    """Q4_KS: each run of 8 groups starts with the 16 rows' d then dmin (the file's float16
    bits), then each group's 16 6-bit scales, then their mins, then the groups' codes (as
    Q4_F32's), each group's on whole 64-byte lines."""
    monkeypatch.setattr(cpu_packed, "Q4VNNI_KS", True)
    rows, cols = 16, 512
    raw = make_raw(Q.Q4_K, rows, cols, 13)
    own = pack_linear(raw, Q.Q4_K, (rows, cols), kind="q4vnni")
    ga = group_affine(raw, Q.Q4_K, (rows, cols))
    blocks = raw.view(rows, cols // 256, 144)
    run_bytes = own.packed.view(2, -1)  # the two runs of the one 16-row block
    assert run_bytes.shape[1] == 320 + 8 * 256
    for run in range(2):
        head = run_bytes[run, :64].view(torch.int16)
        assert torch.equal(head[:16], blocks[:, run, 0:2].contiguous().view(torch.int16)[:, 0])
        assert torch.equal(head[16:], blocks[:, run, 2:4].contiguous().view(torch.int16)[:, 0])
        d = head[:16].view(torch.float16).float()
        dmin = head[16:].view(torch.float16).float()
        for i in range(8):
            g = 8 * run + i
            sc = run_bytes[run, 64 + 16 * i:80 + 16 * i].float()
            mn = run_bytes[run, 192 + 16 * i:208 + 16 * i].float()
            assert torch.equal(d * sc, ga.scale[:, g])
            assert torch.equal(-(dmin * mn), ga.offset[:, g])
            codes = run_bytes[run, 320 + 256 * i:320 + 256 * (i + 1)]
            chunk = codes[0:64].view(16, 4).to(torch.int16)  # quad 0's codes
            assert torch.equal(chunk & 15, ga.codes[:, 32 * g:32 * g + 4].to(torch.int16))


def test_a_wrong_weight_fails_the_check():
    """The oracle check can fail: one nibble changed in the packed bytes moves an output past
    the rounding bound."""
    rows, cols = 16, 64
    raw = make_raw(Q.Q4_1, rows, cols, 7)
    lin = pack_linear(raw, Q.Q4_1, (rows, cols), kind="q4vnni")
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7))
    y_ref, bound = oracle(raw, Q.Q4_1, (rows, cols), x)
    lin.packed[0, 0, 0] ^= 0x08  # row 0, column 0: code +- 8
    err = (lin.matvec(x, torch.empty(1, rows), act_bits=8).double() - y_ref).abs()
    assert bool((err > bound).any())


def test_auto_kind_and_fallback(monkeypatch):
    """kind_for("auto") gives q4vnni for the 4-bit formats where the library is there and
    int4pack with SLIPSTREAM_Q4VNNI=0; other formats are unchanged; no other format packs as
    q4vnni."""
    for q in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        assert kind_for(q) == "q4vnni" and kind_for(q, "q4vnni") == "q4vnni"
        assert kind_for(q, "q8vnni") is None
    assert kind_for(Q.Q8_0) == "q8vnni" and kind_for(Q.Q6_K) == "int8pack"
    assert kind_for(Q.Q8_0, "q4vnni") is None and kind_for(Q.Q6_K, "q4vnni") is None
    assert kind_for(Q.Q6_K, "q8vnni") is None
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", "0")
    assert kind_for(Q.Q4_1) == "int4pack" and kind_for(Q.Q8_0) == "int4pair"
    assert pack_linear(make_raw(Q.Q4_1, 16, 64, 8), Q.Q4_1, (16, 64)).kind == "int4pack"


@pytest.mark.slow
def test_default_model_layer_against_the_oracle(smollm_path):
    """Layer 0's fused matrices of the default model (Q4_1), one bfloat16-valued row each, as
    decode feeds them."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.weights.loader import raw_tensor

    gf = GGUFFile(smollm_path)
    g = torch.Generator().manual_seed(9)
    for parts in (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"],
                  ["ffn_down"]):
        names = [f"blk.0.{p}.weight" for p in parts]
        infos = [gf.tensors[n] for n in names]
        raws = [raw_tensor(gf, n, i.shape).clone() for n, i in zip(names, infos)]
        shapes = [tuple(i.shape) for i in infos]
        lin = cpu_packed.pack_group(raws, [i.ggml_type for i in infos], shapes,
                                    [None] * len(parts), kind="q4vnni")[0]
        raw, rows, cols = torch.cat(raws), sum(s[0] for s in shapes), shapes[0][1]
        x = torch.randn(1, cols, generator=g).to(torch.bfloat16).float()
        y_ref, bound = oracle(raw, infos[0].ggml_type, (rows, cols), x)
        y = lin.matvec(x, torch.empty(1, rows), threads=2, act_bits=8)
        assert bool(((y.double() - y_ref).abs() <= bound * (1 + 1e-6)).all()), parts
    # the tied Q8_0 head (its first 4096 rows): q8vnni
    info = gf.tensors["token_embd.weight"]
    raw = raw_tensor(gf, info.name, info.shape)[:4096].clone()
    lin = pack_linear(raw, Q.Q8_0, (4096, 576), kind="q8vnni")
    x = torch.randn(1, 576, generator=g).to(torch.bfloat16).float()
    y_ref, bound = oracle(raw, Q.Q8_0, (4096, 576), x, 16)
    y = lin.matvec(x, torch.empty(1, 4096), threads=2, act_bits=16)
    assert bool(((y.double() - y_ref).abs() <= bound * (1 + 1e-6)).all())
    gf.close()


def test_q8_packing_layout():
    """q8vnni: chunk j of a group record, bytes 4r..4r+3: row r's columns 4j..4j+3 as q + 128;
    then 16 float16 scales (Q8_0's d)."""
    rows, cols = 16, 64
    raw = make_raw(Q.Q8_0, rows, cols, 11)
    lin = pack_linear(raw, Q.Q8_0, (rows, cols), kind="q8vnni")
    assert isinstance(lin, Q8VnniLinear) and lin.packed.shape == (1, 2, 544)
    ga = group_affine(raw, Q.Q8_0, (rows, cols))
    p = lin.packed[0]
    for g in range(2):
        for j in range(8):
            chunk = p[g, 64 * j:64 * (j + 1)].view(16, 4).to(torch.int16) - 128
            want = ga.codes[:, 32 * g + 4 * j:32 * g + 4 * j + 4].to(torch.int16)
            assert torch.equal(chunk, want)
        assert torch.equal(p[g, 512:544].view(torch.float16).float(), ga.scale[:, g])


@pytest.mark.parametrize("bits", [8, 16])
def test_a_nan_or_infinity_in_x_gives_nan(bits):
    """A non-finite activation makes every output NaN, as a float matmul's would be (not the
    garbage of NaN cast to an integer); the other rows of the call are unaffected."""
    raw = make_raw(Q.Q4_1, 32, 96, 12)
    lin = pack_linear(raw, Q.Q4_1, (32, 96), kind="q4vnni")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(12))
    x[0, 40] = float("nan")
    x[1, 7] = float("inf")
    y = lin.matvec(x, torch.empty(3, 32), act_bits=bits)
    assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())
    assert torch.equal(y[2:], lin.matvec(x[2:], torch.empty(1, 32), act_bits=bits))


@pytest.mark.parametrize("qtype,rows,cols", [s for s in SHAPES if s[0] != Q.Q8_0],
                         ids=[i for s, i in zip(SHAPES, IDS) if s[0] != Q.Q8_0])
def test_float16_scales_kind_against_the_rounded_oracle(qtype, rows, cols, monkeypatch):
    """kind "q4vnni-f16" (the hybrid CPU share's auto-f16): every scale and zero rounded to
    float16, Q4_K's too, so a Q4_K weight takes a sixth fewer bytes; the kernel then computes
    the oracle of the rounded weights within the same rounding bound, and stays within
    float16's rounding (2^-11 of each weight's terms) of the exact GGUF weights."""
    raw = make_raw(qtype, rows, cols, 3)
    monkeypatch.setattr(cpu_packed, "Q4VNNI_KS", False)  # against the float32 records
    lin = pack_linear(raw, qtype, (rows, cols), kind="q4vnni-f16")
    exact = pack_linear(raw, qtype, (rows, cols), kind="q4vnni")
    assert not lin.scale_f32 and lin.nbytes == packed_nbytes(qtype, (rows, cols), "q4vnni-f16")
    if qtype == Q.Q4_K:
        assert lin.nbytes * 6 == exact.nbytes * 5
    else:  # Q4_0/Q4_1's float16 fields: the same weight
        assert torch.equal(lin.packed, exact.packed)
    u, s, z = affine(raw, qtype, (rows, cols))
    s16, z16 = s.half().double(), z.half().double()
    w16 = (u.double().view(rows, -1, 32) * s16[..., None] + z16[..., None]).view(rows, cols)
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    terms = ((u.double().view(rows, -1, 32) * s16[..., None]).abs()
             + z16.abs()[..., None]).view(rows, cols)
    g = torch.Generator().manual_seed(rows)
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        xq = quantized(x, 8)
        bound = (cols // 32 + 3) * F32_U * (xq.abs() @ terms.t())
        y = lin.matvec(x, torch.empty(m, rows), act_bits=8).double()
        assert bool(((y - xq @ w16.t()).abs() <= bound * (1 + 1e-6) + 1e-30).all())
        # against the exact weights: float16's rounding of each scale and zero on top
        off = (y - xq @ w.t()).abs()
        assert bool((off <= bound * (1 + 1e-6) + 2.0 ** -11 * (xq.abs() @ terms.t())).all())


def test_auto_f16_kind_chooses_q4vnni_f16_where_auto_chooses_q4vnni(monkeypatch):
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        assert kind_for(qtype, "auto-f16") == "q4vnni-f16"
    assert kind_for(Q.Q8_0, "auto-f16") == kind_for(Q.Q8_0, "auto")
    assert kind_for(Q.Q6_K, "auto-f16") == kind_for(Q.Q6_K, "auto") == "int8pack"
    monkeypatch.setattr(cpu_packed, "q4vnni_available", lambda: False)
    assert kind_for(Q.Q4_K, "auto-f16") == "int4pack"


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threads_taking_chunks_give_the_bits_of_equal_shares(threads):
    """Threads take the row blocks in chunks as they finish (q4_parallel), not one equal share
    each: every block is still one thread's, computed in one order, so the output is the static
    split's and the single thread's bit for bit, at thread counts that do not divide the 16-row
    blocks (a 70-block weight: more chunks than blocks at 5 threads x 8)."""
    rows, cols = 16 * 70 - 5, 512
    raw = make_raw(Q.Q4_K, rows, cols, 4)
    lin = pack_linear(raw, Q.Q4_K, (rows, cols), kind="q4vnni")
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    assert_chunked_threads_give_the_bits(lin, x, rows, threads)


def test_build_time_defines_are_checked(monkeypatch):
    """SLIPSTREAM_NATIVE_DEFINES (bench/cpu_prefetch.sh) takes -DNAME[=VALUE] words only."""
    monkeypatch.setenv("SLIPSTREAM_NATIVE_DEFINES", "-DQ4_PREFETCH_FAR_RUNS=4; rm -rf /")
    with pytest.raises(ValueError, match="'-DQ4_PREFETCH_FAR_RUNS=4;' is not -DNAME"):
        native._defines()
    monkeypatch.setenv("SLIPSTREAM_NATIVE_DEFINES", "-DQ4_PREFETCH_FAR_RUNS=4 -DNDEBUG")
    assert native._defines() == ("-DQ4_PREFETCH_FAR_RUNS=4", "-DNDEBUG")


# A Q4_KS share computed in a child process built with SLIPSTREAM_NATIVE_DEFINES (the child:
# python -c CODE OUT; exec'd in-process, argv is pytest's, so it only computes)
_BITS_CODE = """
import sys, torch
from gguf import GGMLQuantizationType as Q
from slipstream.weights import cpu_packed
from quant_oracle import make_raw
cpu_packed.Q4VNNI_KS = KS
raw = make_raw(Q.QTYPE, 160, 4096, 21)  # 10 blocks of 16 rows, 38 KiB each (Q4_K)
lin = cpu_packed.pack_linear(raw, Q.QTYPE, (160, 4096), kind=KIND)
x = torch.randn(ROWS, 4096, generator=torch.Generator().manual_seed(22))
ys = [lin.matvec(x, torch.full((ROWS, 160), float("nan")), threads=t, chunks=c, act_bits=b)
      for t, c in ((1, False), (2, False), (2, True)) for b in (8, 16)]
if __name__ == "__main__":
    torch.save(ys, sys.argv[1])
"""


def _bits_under_builds(tmp_path, rows: int, defines: list[str], qtype: str = "Q4_K",
                       k_scales: bool = True, lib_dir: Path | None = None) -> None:
    """Each build's bits (its own library: the defines are part of the cache key) equal this
    process's, on 1 thread and on 2 (equal shares of the blocks, and chunks of them), with
    8-bit and 16-bit activations; Q4_K as its own scales (Q4_KS) unless k_scales is False.
    lib_dir: where the builds go (default tmp_path/lib; tests of several parameters share one,
    so that each build is made once)."""
    import subprocess
    import sys

    code = (_BITS_CODE.replace("ROWS", str(rows)).replace("QTYPE", qtype)
            .replace("KS", str(k_scales)).replace("KIND", repr(KIND[getattr(Q, qtype)])))
    scope: dict = {}
    exec(code, scope)  # this process's library: the defaults
    tests = str(Path(__file__).resolve().parents[1])
    for n, define in enumerate(defines):
        out = tmp_path / f"build{n}.pt"
        env = dict(os.environ, SLIPSTREAM_NATIVE_DEFINES=define,
                   SLIPSTREAM_NATIVE_DIR=str(lib_dir or tmp_path / "lib"),
                   PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True, timeout=300)
        ys = torch.load(out)
        assert all(torch.equal(a, b) for a, b in zip(scope["ys"], ys)), define
    assert len(list((lib_dir or tmp_path / "lib").glob("decode_ops-*.so"))) >= len(defines)


@pytest.mark.slow
def test_q4ks_prefetch_distance_leaves_the_bits(tmp_path):
    """Q4_KS's L2 prefetch (q4_matvec.c's Q4_PREFETCH_FAR_RUNS) only moves bytes into the
    caches: builds without it and far ahead give this process's bits."""
    _bits_under_builds(tmp_path, 3, ["-DQ4_PREFETCH_FAR_RUNS=0", "-DQ4_PREFETCH_FAR_RUNS=16"])


def test_row_passes_tiled_leave_the_bits(tmp_path):
    """q4_matvec.c's Q4_TILE_BYTES (off by default) only reorders the passes over more than
    Q4_MAX_M rows: 9 rows (three passes) in tiles of one block and of three (128 KiB) give the
    untiled bits."""
    _bits_under_builds(tmp_path, 9, ["-DQ4_TILE_BYTES=1", "-DQ4_TILE_BYTES=131072"])


def _has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def amx_builds(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("amx-lib")


@pytest.mark.parametrize("qtype,k_scales", [("Q4_K", True), ("Q4_K", False), ("Q4_0", True),
                                            ("Q8_0", True)], ids=["Q4_KS", "Q4_F32", "Q4_F16",
                                                                  "Q8_F16"])
def test_amx_passes_leave_the_bits(tmp_path, amx_builds, qtype, k_scales):
    """q4_matvec.c's Q4_AMX: passes of more than Q4_MAX_M rows through AMX tiles (19 rows: a
    pass of 16 and one of 3) give the VNNI loop's bits, every record format, both activation
    widths. Q4_AMX=2 does the tile operations in C, so that any AVX-512 VNNI machine tests the
    layout; Q4_AMX=1, the tiles themselves, where the CPU has them (the GPU hosts)."""
    lib = native.library()
    if lib is None or lib.ss_q4_has_vnni() != 1:
        pytest.skip("the AMX loop is built beside the AVX-512 VNNI one only")
    defines = ["-DQ4_AMX=2"] + (["-DQ4_AMX=1"] if _has_amx() else [])
    _bits_under_builds(tmp_path, 19, defines, qtype, k_scales, amx_builds)
    # each build ran the loop it was built for (a Q4_AMX=1 build whose compiler lacked the
    # tiles, or whose kernel refused them, would run VNNI and pass the above by default)
    import subprocess
    import sys

    for define, want in zip(defines, (2, 1)):
        env = dict(os.environ, SLIPSTREAM_NATIVE_DEFINES=define,
                   SLIPSTREAM_NATIVE_DIR=str(amx_builds))
        got = subprocess.run([sys.executable, "-c", "from slipstream import native; "
                              "print(native.library().ss_q4_has_amx())"], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout.split()[-1]
        assert int(got) == want, (define, got)
    assert lib.ss_q4_has_amx() == 0  # the default build: off
