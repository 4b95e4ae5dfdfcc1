"""weights.cpu.iquant's IqLinear and native/iq_matvec.c: IQ3_XXS, IQ2_XXS, IQ3_S and IQ1_S grid
points and sign patterns looked up from the file's own blocks, times 16-bit activations as two
int8 digits.

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (q4_matvec.c's ss_q16_quantize_row, checked in test_q4vnni.py), summed in
float64. gguf-py's float32 weights are exact (a float16 times (0.5 + a 4-bit scale) / 2 or / 4,
or times 1 + 2 x a 4-bit scale, times a grid value of at most 6 bits; IQ1_S: a float16 times
1 + 2 x a 3-bit scale times -1, 0 or 1 shifted by +-1/8: at most 23 bits), and so are the
kernel's scales (IQ1_S's: d (1 + 2 l) / 8, times the integers 8 g +- 1). Per
32-column sub-block the integer sum S is exact; the kernel rounds it to float once (it can pass
2^24), rounds S dx once, the multiply-add into one of 8 lanes once per sub-block, and the 8
lanes' sum 3 times. For G sub-blocks that is at most (G / 8 + 6) 2^-24 sum_k |w_k| |dx X_k| per
output (first-order); the tests hold every output to (G + 6) 2^-24 of it, the cb4 tests' form.
"""

from __future__ import annotations

import gguf.quants
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.weights.cpu import kind_for, pack_group, pack_linear, packed_nbytes
from slipstream.weights.cpu.iquant import IqLinear
from quant_oracle import (assert_bfloat16_in_and_out, assert_chunked_threads_give_the_bits,
                          assert_same_bits_every_way, assert_within_bound, make_raw, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

# odd row counts; whole 256-column blocks
SHAPES = [(Q.IQ3_XXS, 37, 256), (Q.IQ3_XXS, 5, 768), (Q.IQ2_XXS, 23, 512),
          (Q.IQ2_XXS, 64, 256), (Q.IQ3_S, 19, 512), (Q.IQ3_S, 48, 256), (Q.IQ1_S, 29, 512),
          (Q.IQ1_S, 3, 256)]
IDS = [f"{t.name}-{r}x{c}" for t, r, c in SHAPES]
BYTES_PER_BLOCK = {Q.IQ3_XXS: 98, Q.IQ2_XXS: 66, Q.IQ3_S: 110, Q.IQ1_S: 50}


def oracle(raw: torch.Tensor, qtype: Q, shape, x: torch.Tensor):
    """(float64 y of the dequantized weights times the quantized x, the rounding bound)."""
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    xq = quantized(x)
    return xq @ w.t(), (shape[1] // 32 + 6) * F32_U * (xq.abs() @ w.abs().t())


def loops() -> int:
    return native.library().ss_iq_loops()


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
    assert isinstance(lin, IqLinear) and lin.kind == "iq" and lin.out_features == rows
    assert lin.qtype == qtype and lin.in_features == cols
    assert lin.nbytes == packed_nbytes(qtype, (rows, cols)) == \
        rows * cols // 256 * BYTES_PER_BLOCK[qtype]
    assert torch.equal(lin.packed, raw.view(rows, -1))  # the file's bytes, as they are
    assert lin.packed.data_ptr() != raw.data_ptr()  # a copy: the caller's buffer may be reused
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
    same order on the same exact integers; any thread count; a row's bits whatever else
    shares its call."""
    raw = make_raw(qtype, rows, cols, 2)
    lin = pack_linear(raw, qtype, (rows, cols))
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(3))
    assert_same_bits_every_way(lin, x, rows)
    assert_chunked_threads_give_the_bits(lin, x, rows, 2)
    ys = [every_loop(lin, x, rows, t) for t in (1, 2, 3)]
    first = ys[0]["best"].view(torch.int32)
    assert all(torch.equal(y.view(torch.int32), first) for d in ys for y in d.values())


def test_loops_built_where_the_cpu_has_them():
    """-march=native builds the VNNI loop wherever the CPU has AVX-512 VNNI, BW, VL and BMI2,
    and the AVX2 loop wherever it has AVX2 and FMA (else the bit-for-bit tests above compared
    fewer loops)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if all(f" {f}" in flags for f in ("avx512_vnni", "avx512bw", "avx512vl", "bmi2")):
        assert loops() & 1
    if " avx2" in flags and " fma" in flags:
        assert loops() & 2


@pytest.mark.parametrize("qtype", [Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ3_S, Q.IQ1_S])
def test_bfloat16_input_and_output(qtype):
    cols = 512
    lin = pack_linear(make_raw(qtype, 37, cols, 4), qtype, (37, cols))
    assert_bfloat16_in_and_out(lin, 37, cols)


@pytest.mark.parametrize("qtype,byte", [(Q.IQ3_XXS, 2), (Q.IQ3_XXS, 66), (Q.IQ2_XXS, 2),
                                        (Q.IQ2_XXS, 6), (Q.IQ3_S, 2), (Q.IQ3_S, 66),
                                        (Q.IQ3_S, 74), (Q.IQ3_S, 106), (Q.IQ1_S, 2),
                                        (Q.IQ1_S, 35)])
def test_a_wrong_weight_fails_the_check(qtype, byte):
    """The oracle check can fail: one grid index (byte 2), one sign pattern (byte 66 of
    IQ3_XXS, 6 of IQ2_XXS, 74 of IQ3_S), IQ3_S's ninth index bits (66) or its scales (106),
    IQ1_S's high index bits (35) changed in the weight's bytes moves an output past the bound."""
    rows, cols = 16, 256
    raw = make_raw(qtype, rows, cols, 7)
    lin = pack_linear(raw, qtype, (rows, cols))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7))
    y_ref, bound = oracle(raw, qtype, (rows, cols), x)
    assert_within_bound(lin.matvec(x, torch.empty(1, rows)), y_ref, bound, "as read")
    lin.packed[0, byte] ^= 0x05
    for name, y in every_loop(lin, x, rows, 1).items():
        assert bool(((y.double() - y_ref).abs() > bound).any()), name


def test_kind_choice_stacking_and_refusals(monkeypatch):
    """IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S take iq (no torch kernel reads them); iq reads nothing else;
    parts of one format stack into one weight, of two formats stay apart; bias, residual and
    row slices keep the format; bad shapes and types are named."""
    for q in (Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ3_S, Q.IQ1_S):
        assert kind_for(q) == "iq" and kind_for(q, "iq") == "iq"
        assert kind_for(q, "torch") is None and kind_for(q, "cb4") is None
    for q in (Q.Q4_K, Q.Q8_0, Q.IQ4_XS, Q.IQ2_XS, Q.IQ1_M):
        assert kind_for(q, "iq") is None
    cols = 256
    a, b = make_raw(Q.IQ3_XXS, 21, cols, 5), make_raw(Q.IQ2_XXS, 11, cols, 5)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    both, parts = pack_group([a, a], [Q.IQ3_XXS] * 2, [(21, cols)] * 2, [None, None])
    assert parts == [] and isinstance(both, IqLinear) and both.out_features == 42
    alone = pack_linear(a, Q.IQ3_XXS, (21, cols))
    yb = both(x)
    assert torch.equal(yb[:, :21], alone(x)) and torch.equal(yb[:, 21:], alone(x))
    fused, parts = pack_group([a, b], [Q.IQ3_XXS, Q.IQ2_XXS], [(21, cols), (11, cols)],
                              [None, None])
    assert fused is None and [p.qtype for p in parts] == [Q.IQ3_XXS, Q.IQ2_XXS]
    with pytest.raises(ValueError, match="IQ3_XXS, IQ2_XXS"):
        IqLinear.from_raws([a, b], [Q.IQ3_XXS, Q.IQ2_XXS], [(21, cols), (11, cols)])
    with pytest.raises(ValueError, match="not Q4_K"):
        IqLinear.from_raws([make_raw(Q.Q4_K, 16, cols, 1)], [Q.Q4_K], [(16, cols)])
    with pytest.raises(ValueError, match="uint8 bytes"):
        IqLinear.from_raws([torch.zeros(16, 100, dtype=torch.uint8)], [Q.IQ3_XXS],
                           [(16, cols)])
    bias = torch.randn(21)
    lin = pack_group([a, a], [Q.IQ3_XXS] * 2, [(21, cols)] * 2, [bias, bias])[0]
    r = torch.randn(3, 42)
    y = lin(x)
    assert torch.equal(y, lin.matvec(x, torch.empty(3, 42)) + torch.cat([bias, bias]))
    assert torch.equal(lin(x, residual=r), r + y)
    part = lin.row_slice(21, 42)
    assert part.qtype == Q.IQ3_XXS and part.packed.data_ptr() == lin.packed[21].data_ptr()
    assert torch.equal(part(x), y[:, 21:])
    with pytest.raises(ValueError, match=r"needs contiguous \(m, 256\)"):
        lin.matvec(torch.zeros(1, 128), torch.empty(1, 42))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lin.matvec(torch.zeros(1, cols, dtype=torch.float16), torch.empty(1, 42))
    with pytest.raises(ValueError, match="not IQ1_M"):
        IqLinear(lin.packed, 42, qtype=Q.IQ1_M)
    monkeypatch.setattr("slipstream.weights.cpu.kinds.iq_available", lambda: False)
    assert kind_for(Q.IQ3_XXS) is None  # no native library: dense, as before


def test_the_native_expert_sum_takes_iq_experts(monkeypatch):
    """A token's experts (gate/up IQ3_XXS, down IQ2_XXS) in moe_ffn.c's one call, the op-by-op
    loop made to fail: within 1e-3 of the float64 sum of gguf-py's weights (the 16-bit
    activations' error, twice, and float32 sums), on one thread or two; the experts' order
    swapped misses it."""
    from slipstream.weights.cpu import PackedDecodeLinear
    from slipstream.weights.cpu.expert_decode import native_expert_sum

    hidden, units, k = 256, 256, 3
    experts, ws = [], []
    for e in range(k):
        gu_raw = make_raw(Q.IQ3_XXS, 2 * units, hidden, 20 + e)
        dn_raw = make_raw(Q.IQ2_XXS, hidden, units, 30 + e)
        experts.append((PackedDecodeLinear.decode_only(
                            pack_linear(gu_raw, Q.IQ3_XXS, (2 * units, hidden)), 8),
                        PackedDecodeLinear.decode_only(
                            pack_linear(dn_raw, Q.IQ2_XXS, (hidden, units)), 8)))
        ws.append([torch.from_numpy(gguf.quants.dequantize(r.numpy(), t)).double()
                   for r, t in ((gu_raw, Q.IQ3_XXS), (dn_raw, Q.IQ2_XXS))])
    g = torch.Generator().manual_seed(11)
    h = torch.randn(1, hidden, generator=g) * 20
    weights = torch.softmax(torch.randn(k, generator=g), 0)
    ref = torch.zeros(hidden, dtype=torch.float64)
    for (gu, dn), wt in zip(ws, weights.double()):
        a = gu @ h.double()[0]
        ref += wt * (dn @ (torch.nn.functional.silu(a[:units]) * a[units:]))

    def refuse(*args, **kwargs):
        raise AssertionError("the op-by-op loop ran")

    monkeypatch.setattr("slipstream.weights.cpu.expert_decode.expert_sum", refuse)
    ours = native_expert_sum(experts, weights, h)
    rel = float((ours[0].double() - ref).norm() / ref.norm())
    assert rel < 1e-3, rel
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native_expert_sum(experts, weights, h), ours)
    finally:
        torch.set_num_threads(threads)
    swapped = native_expert_sum(experts[1:] + experts[:1], weights, h)
    assert float((swapped[0].double() - ref).norm() / ref.norm()) > 0.1


def test_hybrid_decode_leaves_iq_layers_whole():
    """A GPU's hybrid split sizes the CPU's share from Q4_K's measured speed, which iq's kernel
    does not reach: a layer of iq formats is not split (a Q4_K one is: the control)."""
    from slipstream.hybrid.split import splittable

    names = ("ffn_gate", "ffn_up", "ffn_down")
    assert splittable(dict.fromkeys(names, Q.Q4_K), 1024)
    for q in (Q.IQ3_XXS, Q.IQ1_S):
        assert not splittable(dict.fromkeys(names, q), 1024)
