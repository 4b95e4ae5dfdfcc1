"""weights.cpu.iquant's IqLinear and native/iq_matvec.c: IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S, IQ2_XS,
IQ2_S and IQ1_M grid points and sign patterns looked up from the file's own blocks, times 16-bit
activations as two int8 digits.

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (q4_matvec.c's ss_q16_quantize_row, checked in test_q4vnni.py), summed in
float64. gguf-py's float32 weights are exact (a float16 times (0.5 + a 4-bit scale) / 2 or / 4,
or times 1 + 2 x a 4-bit scale, times a grid value of at most 6 bits; IQ1_S and IQ1_M: a float16
times 1 + 2 x a 3-bit scale times -1, 0 or 1 shifted by +-1/8: at most 23 bits), and so are the
kernel's scales (IQ1_S's: d (1 + 2 l) / 8, times the integers 8 g +- 1). IQ2_XS, IQ2_S and IQ1_M
scale each 16 weights: the kernel multiplies the 16-weight integer sums by their 1 + 2 l (at
most 31 x 43 x 32512 x 16 per half, exact in int32) under the block's d / 8. Per
32-column sub-block the integer sum S is exact; the kernel rounds it to float once (it can pass
2^24), rounds S dx once, the multiply-add into one of 8 lanes once per sub-block, and the 8
lanes' sum 3 times. For G sub-blocks that is at most (G / 8 + 6) 2^-24 sum_k |w_k| |dx X_k| per
output (first-order); the tests hold every output to (G + 6) 2^-24 of it, the cb4 tests' form.
"""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.weights.cpu import kind_for, pack_group, pack_linear, packed_nbytes
from slipstream.weights.cpu.iquant import IqLinear
from quant_oracle import (assert_bfloat16_in_and_out, assert_chunked_threads_give_the_bits,
                          assert_native_expert_sum, assert_same_bits_every_way,
                          assert_within_bound, make_raw, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

# odd row counts; whole 256-column blocks
SHAPES = [(Q.IQ3_XXS, 37, 256), (Q.IQ3_XXS, 5, 768), (Q.IQ2_XXS, 23, 512),
          (Q.IQ2_XXS, 64, 256), (Q.IQ3_S, 19, 512), (Q.IQ3_S, 48, 256), (Q.IQ1_S, 29, 512),
          (Q.IQ1_S, 3, 256), (Q.IQ2_XS, 21, 768), (Q.IQ2_XS, 64, 256), (Q.IQ2_S, 13, 512),
          (Q.IQ2_S, 40, 256), (Q.IQ1_M, 27, 768), (Q.IQ1_M, 2, 256)]
IDS = [f"{t.name}-{r}x{c}" for t, r, c in SHAPES]
BYTES_PER_BLOCK = {Q.IQ3_XXS: 98, Q.IQ2_XXS: 66, Q.IQ3_S: 110, Q.IQ1_S: 50, Q.IQ2_XS: 74,
                   Q.IQ2_S: 82, Q.IQ1_M: 56}
FORMATS = list(BYTES_PER_BLOCK)
# grid points a format's grid holds, and per 256-weight block how many it looks up
GRID_POINTS = {Q.IQ3_XXS: 256, Q.IQ2_XXS: 256, Q.IQ3_S: 512, Q.IQ1_S: 2048, Q.IQ2_XS: 512,
               Q.IQ2_S: 1024, Q.IQ1_M: 2048}
POINTS_PER_BLOCK = {Q.IQ3_XXS: 64, Q.IQ3_S: 64}  # the others: 32 of 8 weights


def set_grid_indices(raw: torch.Tensor, qtype: Q, idx: np.ndarray) -> None:
    """Write grid index idx[b, j] into point j of block b of raw (rows of whole blocks), from
    ggml-common.h's layouts: the low 8 bits in a qs byte (IQ2_XS: the low 9 of a 16-bit word),
    the rest where each format keeps them; every other bit stays as it was."""
    blocks = raw.view(-1, BYTES_PER_BLOCK[qtype]).numpy()
    j = np.arange(idx.shape[1])
    lo, hi = (idx & 0xFF).astype(np.uint8), (idx >> 8).astype(np.uint8)
    if qtype == Q.IQ2_XS:  # qs u16 at 2 + 2 j: index | sign index << 9
        words = blocks[:, 2:66].copy().view("<u2")
        blocks[:, 2:66] = ((words & ~np.uint16(511)) | idx.astype(np.uint16)).view(np.uint8)
        return
    if qtype == Q.IQ2_XXS:  # sub-block g: 4 index bytes, then its sign/scale word
        blocks[:, 2 + 8 * (j // 4) + j % 4] = lo
        return
    start = {Q.IQ3_XXS: 2, Q.IQ3_S: 2, Q.IQ1_S: 2, Q.IQ2_S: 2, Q.IQ1_M: 0}[qtype]
    blocks[:, start + j] = lo
    if qtype == Q.IQ3_S:  # bit j % 8 of qh byte 66 + j // 8
        for p in j:
            at, bit = 66 + p // 8, p % 8
            blocks[:, at] = (blocks[:, at] & ~np.uint8(1 << bit)) | (hi[:, p] << bit)
    elif qtype == Q.IQ2_S:  # bits 2 (j % 4) of qh byte 66 + j // 4
        for p in j:
            at, sh = 66 + p // 4, 2 * (p % 4)
            blocks[:, at] = (blocks[:, at] & ~np.uint8(3 << sh)) | (hi[:, p] << sh)
    elif qtype == Q.IQ1_S:  # bits 3 (j % 4) of the u16 at 34 + 2 (j // 4)
        words = blocks[:, 34:50].copy().view("<u2")
        for p in j:
            w, sh = p // 4, 3 * (p % 4)
            words[:, w] = (words[:, w] & ~np.uint16(7 << sh)) | (hi[:, p].astype(np.uint16) << sh)
        blocks[:, 34:50] = words.view(np.uint8)
    elif qtype == Q.IQ1_M:  # bits 0-2 of nibble j % 2 of qh byte 32 + j // 2
        for p in j:
            at, sh = 32 + p // 2, 4 * (p % 2)
            blocks[:, at] = (blocks[:, at] & ~np.uint8(7 << sh)) | (hi[:, p] << sh)


def set_random_d(raw: torch.Tensor, qtype: Q, seed: int) -> None:
    """Every block's float16 d its own (synth writes one d for all): a factor 0.5 to 2 of the
    first block's, at bytes 0-1, or IQ1_M's top nibbles of its 4 scale words (bytes 49, 51, 53,
    55), so that a kernel reading the wrong block's d, or the nibbles in the wrong order, errs."""
    blocks = raw.view(-1, BYTES_PER_BLOCK[qtype]).numpy()
    rng = np.random.default_rng(seed)
    if qtype == Q.IQ1_M:
        nib = [(blocks[0, 49 + 2 * k] >> 4).astype(np.uint16) << (4 * k) for k in range(4)]
        base = np.uint16(nib[0] | nib[1] | nib[2] | nib[3]).view(np.float16)
    else:
        base = blocks[0, 0:2].copy().view(np.float16)[0]
    d = (np.float32(base) * rng.uniform(0.5, 2.0, len(blocks))).astype(np.float16)
    bits = d.view(np.uint16)
    if qtype == Q.IQ1_M:
        for k in range(4):
            at = 49 + 2 * k
            blocks[:, at] = (blocks[:, at] & 0x0F) | (((bits >> (4 * k)) & 0x0F) << 4).astype(
                np.uint8)
    else:
        blocks[:, 0:2] = bits.view(np.uint8).reshape(-1, 2)


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


@pytest.mark.parametrize("qtype", FORMATS, ids=[t.name for t in FORMATS])
def test_every_grid_point_and_its_own_d_a_block(qtype):
    """Every index of the format's grid looked up (the blocks' points counting 0, 1, 2, ...;
    random signs, shifts and scales), each block with a d of its own: against the oracle on
    every loop, 1 and 5 activation rows."""
    per_block = POINTS_PER_BLOCK.get(qtype, 32)
    cols = 768
    rows = -(-GRID_POINTS[qtype] // (per_block * cols // 256))
    raw = make_raw(qtype, rows, cols, 6)
    n_blocks = rows * cols // 256
    idx = (np.arange(n_blocks * per_block) % GRID_POINTS[qtype]).reshape(n_blocks, per_block)
    set_grid_indices(raw, qtype, idx)
    set_random_d(raw, qtype, 6)
    lin = pack_linear(raw, qtype, (rows, cols))
    g = torch.Generator().manual_seed(6)
    for m in (1, 5):
        x = torch.randn(m, cols, generator=g)
        y_ref, bound = oracle(raw, qtype, (rows, cols), x)
        for name, y in every_loop(lin, x, rows, 2).items():
            assert_within_bound(y, y_ref, bound, f"{qtype.name} m={m} loop={name}")


def test_the_grid_indices_are_where_the_oracle_reads_them():
    """set_grid_indices' control: pointing IQ2_S's and IQ1_M's points at other indices changes
    gguf-py's weights, the high bits too (one point moved by 256 alone)."""
    for qtype in (Q.IQ2_S, Q.IQ1_M, Q.IQ3_S, Q.IQ1_S, Q.IQ2_XS):
        raw = make_raw(qtype, 1, 256, 8)
        per_block = POINTS_PER_BLOCK.get(qtype, 32)
        idx = np.arange(per_block).reshape(1, -1)
        set_grid_indices(raw, qtype, idx)
        before = gguf.quants.dequantize(raw.numpy(), qtype)
        set_grid_indices(raw, qtype, idx)
        assert np.array_equal(gguf.quants.dequantize(raw.numpy(), qtype), before)
        idx[0, 1] += 256
        set_grid_indices(raw, qtype, idx)
        after = gguf.quants.dequantize(raw.numpy(), qtype)
        width = 256 // per_block
        changed = np.flatnonzero((after != before).reshape(-1, width).any(-1))
        assert changed.tolist() == [1], (qtype.name, changed)


@pytest.mark.parametrize("qtype", FORMATS, ids=[t.name for t in FORMATS])
def test_bfloat16_input_and_output(qtype):
    cols = 512
    lin = pack_linear(make_raw(qtype, 37, cols, 4), qtype, (37, cols))
    assert_bfloat16_in_and_out(lin, 37, cols)


WRONG_BYTES = [
    (Q.IQ3_XXS, 2, 5), (Q.IQ3_XXS, 66, 5), (Q.IQ2_XXS, 2, 5), (Q.IQ2_XXS, 6, 5), (Q.IQ3_S, 2, 5),
    (Q.IQ3_S, 66, 5), (Q.IQ3_S, 74, 5), (Q.IQ3_S, 106, 5), (Q.IQ1_S, 2, 5), (Q.IQ1_S, 35, 5),
    (Q.IQ2_XS, 2, 5), (Q.IQ2_XS, 3, 0x01), (Q.IQ2_XS, 3, 0x20), (Q.IQ2_XS, 66, 0x50),
    (Q.IQ2_S, 2, 5), (Q.IQ2_S, 34, 5), (Q.IQ2_S, 66, 0x0c), (Q.IQ2_S, 74, 0x50),
    (Q.IQ1_M, 0, 5), (Q.IQ1_M, 32, 0x50), (Q.IQ1_M, 32, 0x08), (Q.IQ1_M, 48, 0x28),
    (Q.IQ1_M, 49, 0x50)]


@pytest.mark.parametrize("qtype,byte,flip", WRONG_BYTES,
                         ids=[f"{t.name}-{b}^{f:#x}" for t, b, f in WRONG_BYTES])
def test_a_wrong_weight_fails_the_check(qtype, byte, flip):
    """The oracle check can fail: one grid index (byte 2; IQ1_M's 0), one sign pattern (byte 66
    of IQ3_XXS, 6 of IQ2_XXS, 74 of IQ3_S, 34 of IQ2_S, bit 5 of byte 3 of IQ2_XS), IQ3_S's ninth
    index bits (66) or its scales (106), IQ1_S's high index bits (35), IQ2_XS's ninth index bit
    (bit 0 of byte 3) and scales (66: the second 16 weights' nibble), IQ2_S's high index bits
    (66) and scales (74), IQ1_M's high index bits (32, high nibble), its shift's sign (bit 3 of
    byte 32), a 16-weight scale (48) and its d (byte 49's top nibble) changed in the weight's
    bytes moves an output past the bound."""
    rows, cols = 16, 256
    raw = make_raw(qtype, rows, cols, 7)
    lin = pack_linear(raw, qtype, (rows, cols))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(7))
    y_ref, bound = oracle(raw, qtype, (rows, cols), x)
    assert_within_bound(lin.matvec(x, torch.empty(1, rows)), y_ref, bound, "as read")
    lin.packed[0, byte] ^= flip
    for name, y in every_loop(lin, x, rows, 1).items():
        assert bool(((y.double() - y_ref).abs() > bound).any()), name


def test_kind_choice_stacking_and_refusals(monkeypatch):
    """IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S, IQ2_XS, IQ2_S and IQ1_M take iq (no torch kernel reads
    them); iq reads nothing else;
    parts of one format stack into one weight, of two formats stay apart; bias, residual and
    row slices keep the format; bad shapes and types are named."""
    for q in FORMATS:
        assert kind_for(q) == "iq" and kind_for(q, "iq") == "iq"
        assert kind_for(q, "torch") is None and kind_for(q, "cb4") is None
    for q in (Q.Q4_K, Q.Q8_0, Q.IQ4_XS, Q.IQ4_NL, Q.TQ1_0):
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
    with pytest.raises(ValueError, match="not IQ4_XS"):
        IqLinear(lin.packed, 42, qtype=Q.IQ4_XS)
    monkeypatch.setattr("slipstream.weights.cpu.kinds.iq_available", lambda: False)
    assert kind_for(Q.IQ3_XXS) is None  # no native library: dense, as before


@pytest.mark.parametrize("gu_q,dn_q", [(Q.IQ3_XXS, Q.IQ2_XXS), (Q.IQ2_XS, Q.IQ1_M),
                                       (Q.IQ2_S, Q.IQ2_XS), (Q.IQ1_M, Q.IQ2_S)],
                         ids=["IQ3_XXS-IQ2_XXS", "IQ2_XS-IQ1_M", "IQ2_S-IQ2_XS", "IQ1_M-IQ2_S"])
def test_the_native_expert_sum_takes_iq_experts(monkeypatch, gu_q, dn_q):
    """A token's experts (gate/up gu_q, down dn_q) in moe_ffn.c's one call, the op-by-op
    loop made to fail: within 1e-3 of the float64 sum of gguf-py's weights (the 16-bit
    activations' error, twice, and float32 sums), on one thread or two; the experts' order
    swapped misses it."""
    hidden, units, k = 256, 256, 3
    assert_native_expert_sum(gu_q, dn_q, hidden, units, k, monkeypatch)


def test_hybrid_decode_leaves_iq_layers_whole():
    """A GPU's hybrid split sizes the CPU's share from Q4_K's measured speed, which iq's kernel
    does not reach: a layer of iq formats is not split (a Q4_K one is: the control)."""
    from slipstream.hybrid.split import splittable

    names = ("ffn_gate", "ffn_up", "ffn_down")
    assert splittable(dict.fromkeys(names, Q.Q4_K), 1024)
    for q in (Q.IQ3_XXS, Q.IQ1_S):
        assert not splittable(dict.fromkeys(names, q), 1024)
