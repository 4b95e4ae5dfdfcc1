"""weights.cpu.q6vnni's Q6VnniLinear and native/q6_matvec.c: Q6_K's own codes and scales times
16-bit activations held as two int8 digits.

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (q4_matvec.c's ss_q16_quantize_row, checked in test_q4vnni.py), summed in
float64. Per 16-column sub-block j the kernel's integer sum S_j = sum (u - 32) X is exact and
below 2^24 (so exact as a float), and d sc_j is exact in float32; what it may differ by is its
float32 roundings: per sub-block one product (S_j dx) and one multiply-add into the row's sum.
For S sub-blocks that is at most (S + 1) 2^-24 sum_k |w_k dx X_k| per output (first-order);
gguf-py's float32 dequantization rounds d sc_j q once more where the product takes 25 bits
(one more 2^-24 |w_k| each): (S + 2) 2^-24 sum_k |w_k| |dx X_k| in all, which every test holds
every output to.
"""

from __future__ import annotations

import gguf.quants
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.weights.cpu import kind_for, pack_group, pack_linear, packed_nbytes
from slipstream.weights.cpu.groups import group_affine
from slipstream.weights.cpu.q6vnni import Q6V_RUN_BYTES, Q6VnniLinear, q6vnni_available
from slipstream.weights.cpu.torch_kernels import Int8PackLinear
from quant_oracle import (assert_bfloat16_in_and_out, assert_chunked_threads_give_the_bits,
                          assert_same_bits_every_way, assert_within_bound, make_raw, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(not q6vnni_available(),
                                reason="no native library with the AVX-512 VNNI loop")

# odd row counts (the last 16-row block padded) and widths of 1 to 3 super-blocks
SHAPES = [(16, 256), (37, 512), (80, 768), (5, 256)]
IDS = [f"{r}x{c}" for r, c in SHAPES]


def oracle(raw: torch.Tensor, shape, x: torch.Tensor):
    """(float64 y of the dequantized weights times the quantized x, the rounding bound)."""
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.Q6_K)).double()
    xq = quantized(x)
    return xq @ w.t(), (shape[1] // 16 + 2) * F32_U * (xq.abs() @ w.abs().t())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,cols", SHAPES, ids=IDS)
def test_kernel_against_the_oracle(rows, cols, threads):
    """float32 in and out, 1 to 9 activation rows (passes of 4 in the C), both loops."""
    raw = make_raw(Q.Q6_K, rows, cols, 1)
    lin = pack_linear(raw, Q.Q6_K, (rows, cols), kind="q6vnni")
    assert isinstance(lin, Q6VnniLinear) and lin.out_features == rows
    assert lin.nbytes == packed_nbytes(Q.Q6_K, (rows, cols), kind="q6vnni")
    assert lin.nbytes == -(-rows // 16) * 16 * cols * 6.625 / 8  # the file's 6.5625 + the pad
    g = torch.Generator().manual_seed(rows)
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        x[0, :32] *= 50  # one block far larger than the rest
        y_ref, bound = oracle(raw, (rows, cols), x)
        for generic in (False, True):
            y = lin.matvec(x, torch.empty(m, rows), threads=threads, generic=generic)
            assert_within_bound(y, y_ref, bound, f"Q6_K m={m} generic={generic}")


@pytest.mark.parametrize("rows,cols", SHAPES, ids=IDS)
def test_exact_weights_beat_int8pack_and_bfloat16(rows, cols):
    """Against the exact x (not its quantization): q6vnni errs far less than rounding x to
    bfloat16 alone does, and far less than int8pack (Q6_K requantized to int8 per row, the
    layout it replaces)."""
    raw = make_raw(Q.Q6_K, rows, cols, 10)
    lin = pack_linear(raw, Q.Q6_K, (rows, cols), kind="q6vnni")
    int8 = pack_linear(raw, Q.Q6_K, (rows, cols), kind="int8pack")
    assert isinstance(int8, Int8PackLinear)
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.Q6_K)).double()
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(10))
    y_ref = x.double() @ w.t()

    def rel(y):
        return float((y.double() - y_ref).norm() / y_ref.norm())

    ours = rel(lin.matvec(x, torch.empty(4, rows)))
    assert ours < rel(x.to(torch.bfloat16).double() @ w.t()) / 20
    assert ours < rel(int8(x)) / 20


@pytest.mark.parametrize("rows,cols", SHAPES, ids=IDS)
def test_vnni_and_plain_c_agree_bit_for_bit(rows, cols):
    """The same float operations in the same order in both loops, any thread count, and a
    row's bits whatever else shares its call."""
    raw = make_raw(Q.Q6_K, rows, cols, 2)
    lin = pack_linear(raw, Q.Q6_K, (rows, cols), kind="q6vnni")
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(3))
    assert_same_bits_every_way(lin, x, rows)
    assert_chunked_threads_give_the_bits(lin, x, rows, 2)


def test_bfloat16_input_and_output():
    lin = pack_linear(make_raw(Q.Q6_K, 37, 512, 4), Q.Q6_K, (37, 512), kind="q6vnni")
    assert_bfloat16_in_and_out(lin, 37, 512)


def test_linear_call_bias_residual_row_slice_and_parts():
    """__call__ in float32 (plus bias, residual); row_slice shares the packed bytes; parts
    stacked by rows give each part's rows."""
    rows, cols = 48, 256
    raw = make_raw(Q.Q6_K, rows, cols, 5)
    bias = torch.randn(rows)
    lin = pack_group([raw], [Q.Q6_K], [(rows, cols)], [bias], kind="q6vnni")[0]
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    r = torch.randn(3, rows)
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, lin.matvec(x, torch.empty(3, rows)) + bias)
    assert torch.equal(lin(x, residual=r), r + y)
    part = lin.row_slice(16, 48)
    assert part.packed.data_ptr() == lin.packed[1:].data_ptr()
    assert torch.equal(part(x), y[:, 16:48])
    with pytest.raises(ValueError, match="16-row blocks"):
        lin.row_slice(8, 48)
    other = make_raw(Q.Q6_K, 21, cols, 6)  # stacked: rows 48..68, a padded last block
    both = pack_group([raw, other], [Q.Q6_K] * 2, [(rows, cols), (21, cols)], [None, None],
                      kind="q6vnni")[0]
    alone = pack_linear(other, Q.Q6_K, (21, cols), kind="q6vnni")
    yb = both(x)
    assert torch.equal(yb[:, :rows], lin.matvec(x, torch.empty(3, rows)))
    assert torch.equal(yb[:, rows:], alone(x))


def test_packing_layout():
    """A run: the 16 rows' d (the file's float16 bits), the 16 sub-blocks' int8 scales row by
    row, 32 zero bytes, then 8 groups of 384 bytes: the low 4 bits of quad j's codes (row r:
    bytes 4r..4r+3) in chunk j % 4, low nibbles for j < 4; their top 2 bits in chunk j // 4 of
    the next 128 bytes, at bits 2 (j % 4)."""
    rows, cols = 16, 512
    raw = make_raw(Q.Q6_K, rows, cols, 13)
    lin = pack_linear(raw, Q.Q6_K, (rows, cols), kind="q6vnni")
    ga = group_affine(raw, Q.Q6_K, (rows, cols))
    u = (ga.codes.to(torch.int16) + 32)  # the file's codes, 0..63
    blocks = raw.view(rows, cols // 256, 210)
    runs = lin.packed[0]  # (2, 3392)
    assert runs.shape == (2, Q6V_RUN_BYTES)
    for t in range(2):
        run = runs[t]
        assert torch.equal(run[:32].view(torch.int16),
                           blocks[:, t, 208:210].contiguous().view(torch.int16)[:, 0])
        sc = run[32:288].view(torch.int8).view(16, 16)  # (sub-block, row)
        assert torch.equal(sc.t(), blocks[:, t, 192:208].contiguous().view(torch.int8))
        assert not run[288:320].any()
        for gi in range(8):
            p = run[320 + 384 * gi:320 + 384 * (gi + 1)].to(torch.int16)
            for j in range(8):
                low = p[64 * (j % 4):64 * (j % 4 + 1)].view(16, 4)
                low = (low >> 4) if j >= 4 else (low & 15)
                high = (p[256 + 64 * (j // 4):256 + 64 * (j // 4 + 1)].view(16, 4)
                        >> (2 * (j % 4))) & 3
                c0 = 256 * t + 32 * gi + 4 * j
                assert torch.equal(low | high << 4, u[:, c0:c0 + 4]), (t, gi, j)


def test_a_wrong_weight_fails_the_check():
    """The oracle check can fail: one code's top bits changed in the packed bytes move an
    output past the rounding bound."""
    rows, cols = 16, 256
    raw = make_raw(Q.Q6_K, rows, cols, 7)
    lin = pack_linear(raw, Q.Q6_K, (rows, cols), kind="q6vnni")
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7))
    y_ref, bound = oracle(raw, (rows, cols), x)
    assert_within_bound(lin.matvec(x, torch.empty(1, rows)), y_ref, bound, "as packed")
    lin.packed[0, 0, 320 + 256] ^= 0x03  # row 0, column 0: the code +- 16 (or 32, 48)
    err = (lin.matvec(x, torch.empty(1, rows)).double() - y_ref).abs()
    assert bool((err > bound).any())


def test_kind_choice_and_refusals(monkeypatch):
    """Q6_K takes q6vnni where the VNNI loop is built, int8pack with kind="torch" or with the
    native layouts off (SLIPSTREAM_Q4VNNI=0); q6vnni reads nothing else, and whole
    super-blocks only."""
    assert kind_for(Q.Q6_K) == "q6vnni" and kind_for(Q.Q6_K, "q6vnni") == "q6vnni"
    assert kind_for(Q.Q6_K, "torch") == "int8pack"
    for q in (Q.Q4_K, Q.Q8_0, Q.Q4_0):
        assert kind_for(q, "q6vnni") is None
    assert native.library().ss_q6_has_vnni() == 1
    with pytest.raises(ValueError, match="Q6_K only"):
        Q6VnniLinear.from_raws([make_raw(Q.Q4_K, 16, 256, 1)], [Q.Q4_K], [(16, 256)])
    with pytest.raises(ValueError, match="uint8 bytes"):
        Q6VnniLinear.from_raws([torch.zeros(16, 200, dtype=torch.uint8)], [Q.Q6_K],
                               [(16, 256)])
    lin = pack_linear(make_raw(Q.Q6_K, 16, 256, 1), Q.Q6_K, (16, 256), kind="q6vnni")
    with pytest.raises(ValueError, match=r"needs contiguous \(m, 256\)"):
        lin.matvec(torch.zeros(1, 128), torch.empty(1, 16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lin.matvec(torch.zeros(1, 256, dtype=torch.float16), torch.empty(1, 16))
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", "0")
    assert kind_for(Q.Q6_K) == "int8pack"
