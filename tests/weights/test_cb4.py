"""weights.cpu.codebook's Cb4Linear and native/cb4_matvec.c: MXFP4, IQ4_NL and IQ4_XS codes
looked up in their int8 grids, times 16-bit activations held as two int8 digits.

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (q4_matvec.c's ss_q16_quantize_row, checked in test_q4vnni.py), summed in
float64. gguf-py's float32 weights are exact (a float16 or a power of two, times a 6-bit scale,
times a grid value of at most 7 bits: at most 24 bits), and so are the kernel's scales. Per
32-column group the integer sum S = sum v X is exact; the kernel rounds it to float once (it can
pass 2^24 for the IQ4 grids), rounds S dx once, and the multiply-add into the row's sum once.
For G groups that is at most (G + 2) 2^-24 sum_k |w_k| |dx X_k| per output (first-order),
which every test holds every output to.
"""

from __future__ import annotations

import gguf.quants
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.quant.codebook import IQ4NL_VALUES, MXFP4_VALUES
from slipstream.weights.cpu import kind_for, pack_group, pack_linear, packed_nbytes
from slipstream.weights.cpu.codebook import CB4_RECORD_BYTES, Cb4Linear
from quant_oracle import (assert_bfloat16_in_and_out, assert_chunked_threads_give_the_bits,
                          assert_native_expert_sum, assert_same_bits_every_way,
                          assert_within_bound, make_raw, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

# odd row counts (the last 16-row block padded); IQ4_XS in whole 256-column blocks
SHAPES = [(Q.MXFP4, 37, 96), (Q.MXFP4, 16, 2880), (Q.IQ4_NL, 45, 160), (Q.IQ4_NL, 5, 32),
          (Q.IQ4_XS, 23, 256), (Q.IQ4_XS, 80, 768)]
IDS = [f"{t.name}-{r}x{c}" for t, r, c in SHAPES]


def loops() -> int:
    return native.library().ss_cb4_loops()


def oracle(raw: torch.Tensor, qtype: Q, shape, x: torch.Tensor):
    """(float64 y of the dequantized weights times the quantized x, the rounding bound)."""
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    xq = quantized(x)
    return xq @ w.t(), (shape[1] // 32 + 2) * F32_U * (xq.abs() @ w.abs().t())


def every_loop(lin, x, rows, threads):
    """The outputs of the best loop, the plain-C one and (where built) the AVX2 one."""
    out = {"best": lin.matvec(x, torch.empty(x.shape[0], rows), threads=threads),
           "c": lin.matvec(x, torch.empty(x.shape[0], rows), threads=threads, generic=True)}
    if loops() & 2:
        out["avx2"] = lin.matvec(x, torch.empty(x.shape[0], rows), threads=threads, avx2=True)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_kernel_against_the_oracle(qtype, rows, cols, threads):
    """float32 in and out, 1 to 9 activation rows (passes of 4 in the C), every loop."""
    raw = make_raw(qtype, rows, cols, 1)
    lin = pack_linear(raw, qtype, (rows, cols))
    assert isinstance(lin, Cb4Linear) and lin.kind == "cb4" and lin.out_features == rows
    assert lin.grid == int(qtype == Q.MXFP4)
    assert lin.nbytes == packed_nbytes(qtype, (rows, cols)) == -(-rows // 16) * 16 * cols * 5 / 8
    g = torch.Generator().manual_seed(rows)
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        x[0, :32] *= 50  # one block far larger than the rest
        y_ref, bound = oracle(raw, qtype, (rows, cols), x)
        for name, y in every_loop(lin, x, rows, threads).items():
            assert_within_bound(y, y_ref, bound, f"{qtype.name} m={m} loop={name}")


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_every_loop_and_thread_count_give_the_same_bits(qtype, rows, cols):
    """VNNI, AVX2 (forced where VNNI is built) and plain C: the same float operations in the
    same order on the same exact integers; any thread count; a row's bits whatever else shares
    its call."""
    raw = make_raw(qtype, rows, cols, 2)
    lin = pack_linear(raw, qtype, (rows, cols))
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(3))
    assert_same_bits_every_way(lin, x, rows)
    assert_chunked_threads_give_the_bits(lin, x, rows, 2)
    ys = [every_loop(lin, x, rows, t) for t in (1, 2, 3)]
    first = ys[0]["best"].view(torch.int32)
    assert all(torch.equal(y.view(torch.int32), first) for d in ys for y in d.values())


def test_loops_built_where_the_cpu_has_them():
    """-march=native builds the VNNI loop wherever the CPU has it and the AVX2 loop wherever it
    has AVX2 and FMA (else the bit-for-bit tests above compared fewer loops)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if " avx512_vnni" in flags and " avx512bw" in flags:
        assert loops() & 1
    if " avx2" in flags and " fma" in flags:
        assert loops() & 2


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.IQ4_XS])
def test_bfloat16_input_and_output(qtype):
    cols = 256
    lin = pack_linear(make_raw(qtype, 37, cols, 4), qtype, (37, cols))
    assert_bfloat16_in_and_out(lin, 37, cols)


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_packing_layout(qtype, rows, cols):
    """Each record: row r's codes of columns 4j..4j+3 at bytes 4r..4r+3 of 64-byte chunk j % 4
    (low nibbles for j < 4), then the 16 rows' float32 scales; the grid value of each code
    times its scale is gguf-py's dequantized weight, bit for bit; padding rows are zeros."""
    raw = make_raw(qtype, rows, cols, 13)
    lin = pack_linear(raw, qtype, (rows, cols))
    grid = torch.tensor(MXFP4_VALUES if qtype == Q.MXFP4 else IQ4NL_VALUES, dtype=torch.float32)
    p = lin.packed  # (blocks, groups, 320)
    blocks, groups = p.shape[0], p.shape[1]
    assert p.shape[2] == CB4_RECORD_BYTES
    codes = p[..., :256].view(blocks, groups, 4, 16, 4).to(torch.int64)  # chunk, row, t
    quads = torch.cat([codes & 15, codes >> 4], dim=2)  # (blocks, groups, quad j, row, t)
    c = quads.permute(0, 3, 1, 2, 4).reshape(blocks * 16, cols)
    s = p[..., 256:].contiguous().view(torch.float32).view(blocks, groups, 16)
    s = s.permute(0, 2, 1).reshape(blocks * 16, groups)
    w = grid[c] * s.repeat_interleave(32, dim=1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))
    assert torch.equal(w[:rows], ref)
    assert not c[rows:].any() and not s[rows:].any()


def test_a_wrong_weight_fails_the_check():
    """The oracle check can fail: one code changed in the packed bytes moves an output past the
    rounding bound."""
    rows, cols = 16, 256
    raw = make_raw(Q.IQ4_XS, rows, cols, 7)
    lin = pack_linear(raw, Q.IQ4_XS, (rows, cols))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7))
    y_ref, bound = oracle(raw, Q.IQ4_XS, (rows, cols), x)
    assert_within_bound(lin.matvec(x, torch.empty(1, rows)), y_ref, bound, "as packed")
    lin.packed[0, 0, 0] ^= 0x04  # row 0, column 0: another grid value
    err = (lin.matvec(x, torch.empty(1, rows)).double() - y_ref).abs()
    assert bool((err > bound).any())


def test_mxfp4_scales_across_the_exponent_range():
    """MXFP4's e8m0 scales as float32, exactly, far from 1 both ways (2^-60 .. 2^40)."""
    rows, cols = 16, 64
    raw = make_raw(Q.MXFP4, rows, cols, 8)
    blocks = raw.view(rows, cols // 32, 17)
    blocks[:, :, 0] = torch.randint(68, 168, (rows, cols // 32), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(8))
    lin = pack_linear(raw, Q.MXFP4, (rows, cols))
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(9))
    y_ref, bound = oracle(raw, Q.MXFP4, (rows, cols), x)
    for name, y in every_loop(lin, x, rows, 1).items():
        assert_within_bound(y, y_ref, bound, f"loop={name}")


def test_kind_choice_stacking_and_refusals(monkeypatch):
    """The codebook formats take cb4 (no torch kernel reads them); cb4 reads nothing else;
    IQ4_NL and IQ4_XS stack into one weight, MXFP4 with them does not (another grid); bias,
    residual and row slices keep the grid."""
    for q in (Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS):
        assert kind_for(q) == "cb4" and kind_for(q, "cb4") == "cb4"
        assert kind_for(q, "torch") is None and kind_for(q, "q4vnni") is None
    for q in (Q.Q4_K, Q.Q8_0, Q.Q6_K):
        assert kind_for(q, "cb4") is None
    cols = 256
    nl, xs, mx = (make_raw(q, r, cols, 5) for q, r in ((Q.IQ4_NL, 21), (Q.IQ4_XS, 32),
                                                       (Q.MXFP4, 16)))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    both, parts = pack_group([nl, xs], [Q.IQ4_NL, Q.IQ4_XS], [(21, cols), (32, cols)],
                             [None, None])
    assert parts == [] and isinstance(both, Cb4Linear) and both.out_features == 53
    alone = [pack_linear(nl, Q.IQ4_NL, (21, cols)), pack_linear(xs, Q.IQ4_XS, (32, cols))]
    yb = both(x)
    assert torch.equal(yb[:, :21], alone[0](x)) and torch.equal(yb[:, 21:], alone[1](x))
    fused, parts = pack_group([mx, xs], [Q.MXFP4, Q.IQ4_XS], [(16, cols), (32, cols)],
                              [None, None])
    assert fused is None and [p.grid for p in parts] == [1, 0]
    with pytest.raises(ValueError, match="one grid"):
        Cb4Linear.from_raws([mx, xs], [Q.MXFP4, Q.IQ4_XS], [(16, cols), (32, cols)])
    with pytest.raises(ValueError, match="Q4_K"):
        Cb4Linear.from_raws([make_raw(Q.Q4_K, 16, cols, 1)], [Q.Q4_K], [(16, cols)])
    with pytest.raises(ValueError, match="uint8 bytes"):
        Cb4Linear.from_raws([torch.zeros(16, 100, dtype=torch.uint8)], [Q.IQ4_NL],
                            [(16, cols)])
    bias = torch.randn(16)
    lin = pack_group([mx, mx], [Q.MXFP4] * 2, [(16, cols)] * 2, [bias, bias])[0]
    r = torch.randn(3, 32)
    y = lin(x)
    assert torch.equal(y, lin.matvec(x, torch.empty(3, 32)) + torch.cat([bias, bias]))
    assert torch.equal(lin(x, residual=r), r + y)
    part = lin.row_slice(16, 32)
    assert part.grid == 1 and part.packed.data_ptr() == lin.packed[1:].data_ptr()
    assert torch.equal(part(x), y[:, 16:])
    with pytest.raises(ValueError, match=r"needs contiguous \(m, 256\)"):
        lin.matvec(torch.zeros(1, 128), torch.empty(1, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lin.matvec(torch.zeros(1, cols, dtype=torch.float16), torch.empty(1, 32))
    with pytest.raises(ValueError, match="grid must be"):
        Cb4Linear(lin.packed, 32, grid=2)
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", "0")  # torch's kernels for the others: none here
    assert kind_for(Q.IQ4_XS) == "cb4" and kind_for(Q.Q4_K) == "int4pack"
    monkeypatch.setattr("slipstream.weights.cpu.kinds.cb4_available", lambda: False)
    assert kind_for(Q.IQ4_XS) is None  # no native library: dense, as before


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.IQ4_XS])
def test_the_native_expert_sum_takes_cb4_experts(qtype, monkeypatch):
    """A token's cb4 experts (gate/up in qtype, down in qtype's 32-column sibling where its
    64-column rows are no IQ4_XS block) in moe_ffn.c's one call, the op-by-op loop made to
    fail: within 1e-3 of the float64 sum of gguf-py's weights (the 16-bit activations' error,
    twice, and float32 sums), on one thread or two; the experts' order swapped misses it."""
    hidden, units, k = 256, 64, 3
    down_q = Q.MXFP4 if qtype == Q.MXFP4 else Q.IQ4_NL
    assert_native_expert_sum(qtype, down_q, hidden, units, k, monkeypatch)
