"""weights.cpu.vnni's Q4VnniLinear, Q8VnniLinear and native/q4_matvec.c: 4-bit (and Q8_0's
8-bit) weights times 16-bit activations held as two int8 digits.

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (X = 256 hi + lo and per-32 scales dx from `ss_q16_quantize_row`,
themselves checked against a torch reimplementation), summed in float64. The kernel's sums of
code products are exact integers (below 2^24 for 4-bit codes), so what it may differ by is its
float32 roundings alone: per group one product (isum * dx), one multiply-add into the scale term
and one into the zero term (whose dx * sum(X) is rounded once too), then one final add. For G
groups that is at most (G + 3) 2^-24 sum_k (|s_g u_k| + |z_g|) |dx X_k| per output
(first-order), which each test holds every output to.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
import gguf.quants

from slipstream import native
from slipstream.weights.cpu import kind_for, pack_group, pack_linear, packed_nbytes
from slipstream.weights.cpu.groups import group_affine
from slipstream.weights.cpu.vnni import Q4VnniLinear, Q8VnniLinear, q4vnni_params
from quant_oracle import (assert_bfloat16_in_and_out, assert_chunked_threads_give_the_bits,
                          assert_same_bits_every_way, assert_within_bound, make_raw,
                          quantize16_rows, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

# (format, rows, cols): odd row counts (the last 16-row block padded), and widths that are not
# a multiple of 256 where the format allows it (Q4_0, Q4_1: blocks of 32; Q4_K: 256)
SHAPES = [(Q.Q4_0, 37, 96), (Q.Q4_0, 16, 32), (Q.Q4_1, 45, 160), (Q.Q4_1, 64, 576),
          (Q.Q4_K, 23, 256), (Q.Q4_K, 80, 768), (Q.Q8_0, 29, 96), (Q.Q8_0, 48, 576),
          (Q.Q5_1, 37, 96), (Q.Q5_1, 48, 576), (Q.Q5_K, 23, 256), (Q.Q5_K, 80, 768)]
KIND = {Q.Q4_0: "q4vnni", Q.Q4_1: "q4vnni", Q.Q4_K: "q4vnni", Q.Q8_0: "q8vnni",
        Q.Q5_1: "q8vnni", Q.Q5_K: "q8vnni"}
EIGHT_BIT = (Q.Q8_0, Q.Q5_1, Q.Q5_K)  # q8vnni's 8-bit codes
IDS = [f"{t.name}-{r}x{c}" for t, r, c in SHAPES]


def affine(raw: torch.Tensor, qtype: Q, shape):
    """(u, s, z) with w = s u + z: the kernel's unsigned codes and per-group scale and zero."""
    ga = group_affine(raw, qtype, shape)
    if qtype == Q.Q8_0:
        return ga.codes.to(torch.int16) + 128, ga.scale, -128 * ga.scale
    if qtype in EIGHT_BIT:  # five-bit codes and their mins
        return ga.codes.to(torch.int16), ga.scale, ga.offset
    return q4vnni_params(ga)


def oracle(raw: torch.Tensor, qtype: Q, shape, x: torch.Tensor):
    """(float64 y of the dequantized weights times the quantized x, the rounding bound per
    output), x float32 (m, k). Per group: a product, two multiply-adds (and for 8-bit codes,
    whose sums with X pass 2^24, the sum's conversion to float); then one add."""
    rows, cols = shape
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    xq = quantized(x)
    u, s, z = affine(raw, qtype, shape)
    terms = ((u.double().view(rows, -1, 32) * s.double()[..., None]).abs()
             + z.double().abs()[..., None]).view(rows, cols)
    roundings = cols // 32 + 3 + (qtype in EIGHT_BIT)
    return xq @ w.t(), roundings * F32_U * (xq.abs() @ terms.t())


def test_quantizer_matches_torch():
    """dx = max|x| / 32512 in float32, X = round-half-even(x / dx) clamped to 32512 (as two
    int8 digits, X = 256 hi + lo), sx = dx sum(X); an all-zero block gives zeros; halves round
    to even."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    x[1, 32:64] = 0.0  # a zero block
    x[2, 64:96] = torch.arange(32) - 15.5  # halves, and with max |x| = 32512 dx = 1 exactly:
    x[2, 64] = -32512.0  # so x / dx hits exact halves
    X, dx = quantize16_rows(x)  # (which checks sx = dx sum(X))
    blocks = x.view(3, -1, 32)
    d_ref = blocks.abs().amax(-1) / 32512.0
    safe = torch.where(d_ref == 0, torch.ones_like(d_ref), d_ref)
    X_ref = torch.round(blocks / safe[..., None]).clamp(-32512, 32512)
    X_ref = torch.where(d_ref[..., None] == 0, torch.zeros_like(X_ref), X_ref).to(torch.int32)
    assert torch.equal(dx, d_ref)
    assert torch.equal(X.view(3, -1, 32), X_ref)
    assert torch.equal(X[1, 32:64], torch.zeros(32, dtype=torch.int32)) and dx[1, 1] == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_kernel_against_the_oracle(qtype, rows, cols, threads):
    """float32 in and out, 1 to 9 activation rows (passes of 4 in the C), both loops."""
    k_scales = qtype == Q.Q4_K  # Q4_K alone keeps its own scales
    raw = make_raw(qtype, rows, cols, 1)
    lin = pack_linear(raw, qtype, (rows, cols), kind=KIND[qtype])
    assert isinstance(lin, Q4VnniLinear) and lin.out_features == rows
    assert lin.kind == KIND[qtype]
    assert lin.nbytes == packed_nbytes(qtype, (rows, cols), kind=KIND[qtype])
    assert lin.k_scales == k_scales
    # Q4_0/Q4_1/Q8_0's fields are float16s; Q4_K's float32 records or its own scales; Q5_1's
    # and Q5_K's float32 records (q8vnni's Q8_F32)
    assert lin.scale_f32 == (qtype == Q.Q4_K and not k_scales)
    assert lin.packed.shape[2] == (640 if qtype in (Q.Q5_1, Q.Q5_K) else
                                   544 if qtype == Q.Q8_0 else lin.packed.shape[2])
    g = torch.Generator().manual_seed(rows)
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        x[0, :32] *= 50  # one block far larger than the rest
        y_ref, bound = oracle(raw, qtype, (rows, cols), x)
        for generic in (False, True):
            y = lin.matvec(x, torch.empty(m, rows), threads=threads, generic=generic)
            assert_within_bound(y, y_ref, bound, f"{qtype.name} m={m} generic={generic}")


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_16_bit_activations_lose_less_than_bfloat16(qtype, rows, cols):
    """Against the exact x (not its quantization): 16-bit activations err far less than
    rounding x to bfloat16 does."""
    raw = make_raw(qtype, rows, cols, 10)
    lin = pack_linear(raw, qtype, (rows, cols), kind=KIND[qtype])
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(10))
    y_ref = x.double() @ w.t()

    def rel(y):
        return float((y.double() - y_ref).norm() / y_ref.norm())

    bf16 = rel(x.to(torch.bfloat16).double() @ w.t())
    two = rel(lin.matvec(x, torch.empty(4, rows)))
    assert two < bf16 / 20, (two, bf16)


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
    lin = pack_linear(make_raw(Q.Q4_1, 45, 160, 4), Q.Q4_1, (45, 160), kind="q4vnni")
    assert_bfloat16_in_and_out(lin, 45, 160)


def test_linear_call_bias_residual_and_row_slice():
    """__call__ in float32 (plus bias, residual), row_slice shares the packed bytes."""
    rows, cols = 48, 96
    raw = make_raw(Q.Q4_0, rows, cols, 5)
    bias = torch.randn(rows)
    lin = pack_group([raw], [Q.Q4_0], [(rows, cols)], [bias], kind="q4vnni")[0]
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


@pytest.mark.parametrize("rows,cols", [(32, 256), (80, 768)])
def test_q4k_own_scales_give_the_float32_records_bits(rows, cols):
    """Q4_K packed with its own scales (4.625 bits a weight, Q4_K alone) gives the bits of the
    float32 records (6 bits) that Q4_K takes stacked with another 4-bit format, in both loops:
    d sc and -dmin mn are the same exact products either way."""
    raw = make_raw(Q.Q4_K, rows, cols, 11)
    other = make_raw(Q.Q4_0, 16, cols, 12)
    own = pack_linear(raw, Q.Q4_K, (rows, cols), kind="q4vnni")
    f32 = pack_group([raw, other], [Q.Q4_K, Q.Q4_0], [(rows, cols), (16, cols)], [None, None],
                     kind="q4vnni")[0]
    assert own.k_scales and f32.scale_f32 and not f32.k_scales
    assert own.nbytes * 8 == -(-rows // 16) * 16 * cols * 4.625
    assert f32.nbytes * 8 == (-(-rows // 16) * 16 + 16) * cols * 6
    assert own.nbytes == packed_nbytes(Q.Q4_K, (rows, cols), kind="q4vnni")
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(12))
    x[1, 64:96] *= -40
    for generic in (False, True):
        a = own.matvec(x, torch.empty(5, rows), generic=generic)
        b = f32.matvec(x, torch.empty(5, rows + 16), generic=generic)
        assert torch.equal(a, b[:, :rows]), generic


def test_q4k_own_scales_layout():
    """Q4_KS: each run of 8 groups starts with the 16 rows' d then dmin (the file's float16
    bits), then each group's 16 6-bit scales, then their mins, then the groups' codes (as
    Q4_F32's), each group's on whole 64-byte lines."""
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
    err = (lin.matvec(x, torch.empty(1, rows)).double() - y_ref).abs()
    assert bool((err > bound).any())


def test_auto_kind_and_fallback(monkeypatch):
    """kind_for("auto") gives q4vnni for the 4-bit formats where the library is there and
    int4pack with SLIPSTREAM_Q4VNNI=0; other formats are unchanged; no other format packs as
    q4vnni."""
    for q in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        assert kind_for(q) == "q4vnni" and kind_for(q, "q4vnni") == "q4vnni"
        assert kind_for(q, "q8vnni") is None
    assert kind_for(Q.Q8_0) == "q8vnni" and kind_for(Q.Q6_K) in ("q6vnni", "int8pack")
    assert kind_for(Q.Q8_0, "q4vnni") is None and kind_for(Q.Q6_K, "q4vnni") is None
    assert kind_for(Q.Q6_K, "q8vnni") is None
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", "0")
    assert kind_for(Q.Q4_1) == "int4pack" and kind_for(Q.Q8_0) == "int4pair"
    assert kind_for(Q.Q6_K) == "int8pack"
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
        lin = pack_group(raws, [i.ggml_type for i in infos], shapes, [None] * len(parts),
                         kind="q4vnni")[0]
        raw, rows, cols = torch.cat(raws), sum(s[0] for s in shapes), shapes[0][1]
        x = torch.randn(1, cols, generator=g).to(torch.bfloat16).float()
        y_ref, bound = oracle(raw, infos[0].ggml_type, (rows, cols), x)
        y = lin.matvec(x, torch.empty(1, rows), threads=2)
        assert bool(((y.double() - y_ref).abs() <= bound * (1 + 1e-6)).all()), parts
    # the tied Q8_0 head (its first 4096 rows): q8vnni
    info = gf.tensors["token_embd.weight"]
    raw = raw_tensor(gf, info.name, info.shape)[:4096].clone()
    lin = pack_linear(raw, Q.Q8_0, (4096, 576), kind="q8vnni")
    x = torch.randn(1, 576, generator=g).to(torch.bfloat16).float()
    y_ref, bound = oracle(raw, Q.Q8_0, (4096, 576), x)
    y = lin.matvec(x, torch.empty(1, 4096), threads=2)
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


def test_a_nan_or_infinity_in_x_gives_nan():
    """A non-finite activation makes every output NaN, as a float matmul's would be (not the
    garbage of NaN cast to an integer); the other rows of the call are unaffected."""
    raw = make_raw(Q.Q4_1, 32, 96, 12)
    lin = pack_linear(raw, Q.Q4_1, (32, 96), kind="q4vnni")
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(12))
    x[0, 40] = float("nan")
    x[1, 7] = float("inf")
    y = lin.matvec(x, torch.empty(3, 32))
    assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())
    assert torch.equal(y[2:], lin.matvec(x[2:], torch.empty(1, 32)))


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threads_taking_chunks_give_the_single_threads_bits(threads):
    """Threads take the row blocks in chunks as they finish (parallel.h), not one equal share
    each: every block is still one thread's, computed in one order, so the output is the single
    thread's bit for bit, at thread counts that do not divide the 16-row blocks (a 70-block
    weight: more chunks than blocks at 5 threads x 8)."""
    rows, cols = 16 * 70 - 5, 512
    raw = make_raw(Q.Q4_K, rows, cols, 4)
    lin = pack_linear(raw, Q.Q4_K, (rows, cols), kind="q4vnni")
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    assert_chunked_threads_give_the_bits(lin, x, rows, threads)


def test_build_time_defines_are_checked(monkeypatch):
    """SLIPSTREAM_NATIVE_DEFINES takes -DNAME[=VALUE] words only."""
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
from slipstream.weights.cpu import pack_linear
from quant_oracle import make_raw
raw = make_raw(Q.QTYPE, 160, 4096, 21)  # 10 blocks of 16 rows, 38 KiB each (Q4_K)
lin = pack_linear(raw, Q.QTYPE, (160, 4096), kind=KIND)
x = torch.randn(ROWS, 4096, generator=torch.Generator().manual_seed(22))
ys = [lin.matvec(x, torch.full((ROWS, 160), float("nan")), threads=t) for t in (1, 2)]
if __name__ == "__main__":
    torch.save(ys, sys.argv[1])
"""


def _bits_under_builds(tmp_path, rows: int, defines: list[str], qtype: str = "Q4_K",
                       lib_dir: Path | None = None) -> None:
    """Each build's bits (its own library: the defines are part of the cache key) equal this
    process's, on 1 thread and on 2. lib_dir: where the builds go (default tmp_path/lib)."""
    import subprocess
    import sys

    code = (_BITS_CODE.replace("ROWS", str(rows)).replace("QTYPE", qtype)
            .replace("KIND", repr(KIND[getattr(Q, qtype)])))
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
