"""hybrid.plane_host.PlaneLinear and native/plane_matvec.c: the CPU computing on the GPU
kernels' planes (kernels.pack) in host memory, as hybrid decode's CPU share does when it reads
the pinned image in place (SLIPSTREAM_HYBRID_KIND=planes).

The oracle: gguf-py's `dequantize` of the same GGUF bytes (float64) times the activations as the
kernel quantizes them (tests/quant_oracle.py), summed in float64. The kernel's integer sums are
exact, so it may differ by its float32 roundings alone: per unit of 32 one product and two
multiply-adds, then per row the lanes' 8 adds and 7 more: at most (units + 17) 2^-24
sum_k (|s u_k| + |z|) |x_k| per output (first-order), which every output is held to."""

from __future__ import annotations

import dataclasses

import gguf.quants
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.kernels.pack import pack_weight
from slipstream.weights import cpu_packed
from slipstream.weights.cpu_packed import group_affine
from slipstream.hybrid.plane_host import PlaneLinear, plane_nbytes, plane_readable
from quant_oracle import (assert_chunked_threads_give_the_bits, assert_same_bits_every_way,
                          assert_within_bound, make_raw, quantized)

F32_U = 2.0 ** -24

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

# units per row: odd (3, 5: a last unit without a pair), not a multiple of 8 (18, 12: the vector
# loop leaves a tail of 2 or 4 units to the plain-C one, in pairs, or with VNNI a quad), whole
# super-blocks (Q4_K: 8, 24); odd row counts leave a row out of the loops' pairs of rows
SHAPES = [(Q.Q4_0, 37, 96), (Q.Q4_0, 16, 576), (Q.Q4_0, 19, 384), (Q.Q4_1, 45, 160),
          (Q.Q4_1, 64, 512), (Q.Q4_K, 23, 256), (Q.Q4_K, 80, 768)]
IDS = [f"{t.name}-{r}x{c}" for t, r, c in SHAPES]


def planes_of(raw: torch.Tensor, qtype: Q, rows: int, cols: int):
    return pack_weight(raw.reshape(-1), qtype, rows, cols)


def oracle(raw: torch.Tensor, qtype: Q, rows: int, cols: int, x: torch.Tensor, bits: int):
    """(float64 y of the dequantized weights times the quantized x, the rounding bound)."""
    w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    xq = quantized(x, bits)
    u, s, z = cpu_packed._q4vnni_params(group_affine(raw, qtype, (rows, cols)))
    terms = ((u.double().view(rows, -1, 32) * s.double()[..., None]).abs()
             + z.double().abs()[..., None]).view(rows, cols)
    return xq @ w.t(), (cols // 32 + 17) * F32_U * (xq.abs() @ terms.t())


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_kernel_against_the_oracle(qtype, rows, cols, bits):
    """1 to 9 activation rows (passes of 4 in the C), one and two threads, both loops."""
    raw = make_raw(qtype, rows, cols, 1)
    lin = PlaneLinear(planes_of(raw, qtype, rows, cols))
    assert lin.out_features == rows and lin.in_features == cols
    g = torch.Generator().manual_seed(rows)
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        x[0, :32] *= 50  # one block far larger than the rest
        y_ref, bound = oracle(raw, qtype, rows, cols, x, bits)
        for threads in (1, 2):
            for generic in (False, True):
                y = lin.matvec(x, torch.empty(m, rows), threads=threads, generic=generic,
                               act_bits=bits)
                assert_within_bound(y, y_ref, bound, f"{qtype.name} m={m} threads={threads} "
                                                     f"generic={generic}")


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_simd_and_plain_c_agree_bit_for_bit(qtype, rows, cols):
    """The same float operations in the same order in both loops, any thread count, and a row's
    bits whatever else shares its call."""
    raw = make_raw(qtype, rows, cols, 2)
    lin = PlaneLinear(planes_of(raw, qtype, rows, cols))
    assert_same_bits_every_way(lin, torch.randn(6, cols,
                                                generator=torch.Generator().manual_seed(3)),
                               rows)


def test_has_a_vector_loop_where_the_cpu_does():
    """-march=native builds the VNNI loop wherever the CPU has AVX-512 VNNI (the GPU hosts'
    Xeons: the loop is run and checked against the plain-C one only there) and the AVX2 one
    elsewhere with AVX2 (else the tests above ran the plain-C loop twice)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    lib = native.library()
    if " avx2" in flags and " fma" in flags and " f16c" in flags:
        assert lib.ss_plane_has_simd() == 1
    assert lib.ss_plane_has_vnni() == int(" avx512_vnni" in flags and " avx512bw" in flags)


@pytest.mark.parametrize("qtype,rows,cols", SHAPES, ids=IDS)
def test_it_agrees_with_q4vnni_on_the_same_bytes(qtype, rows, cols):
    """The same weights and the same activation quantization as the CPU layout it replaces:
    the two differ by float32 summation order alone."""
    raw = make_raw(qtype, rows, cols, 4)
    planes = PlaneLinear(planes_of(raw, qtype, rows, cols))
    q4v = cpu_packed.pack_linear(raw, qtype, (rows, cols), kind="q4vnni")
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    _, bound = oracle(raw, qtype, rows, cols, x, 16)
    a = planes.matvec(x, torch.empty(3, rows), act_bits=16)
    b = q4v.matvec(x, torch.empty(3, rows), act_bits=16)
    assert bool(((a.double() - b.double()).abs() <= 2 * bound + 1e-30).all())


def test_the_planes_are_read_in_place_and_their_bytes_counted():
    raw = make_raw(Q.Q4_K, 32, 512, 6)
    packed = planes_of(raw, Q.Q4_K, 32, 512)
    lin = PlaneLinear(packed)
    assert lin.packed.lo.data_ptr() == packed.lo.data_ptr()  # no copy
    assert lin.nbytes == packed.nbytes == plane_nbytes(Q.Q4_K, 32, 512)
    # 4.625 bits a weight, against GGUF's 4.5 and q4vnni's 6
    assert lin.nbytes * 8 / (32 * 512) == 4.625
    for qtype in (Q.Q4_0, Q.Q4_1):
        p = planes_of(make_raw(qtype, 16, 96, 7), qtype, 16, 96)
        assert p.nbytes == plane_nbytes(qtype, 16, 96)


def test_bfloat16_input_and_a_residual():
    raw = make_raw(Q.Q4_1, 48, 256, 8)
    lin = PlaneLinear(planes_of(raw, Q.Q4_1, 48, 256))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8))
    res = torch.randn(2, 48, generator=torch.Generator().manual_seed(9))
    want = lin.matvec(x.bfloat16().float(), torch.empty(2, 48)) + res.bfloat16().float()
    got = lin(x.bfloat16(), residual=res.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())


def test_what_it_cannot_read_is_refused():
    q6 = planes_of(make_raw(Q.Q6_K, 16, 256, 1), Q.Q6_K, 16, 256)  # a high-bit plane
    assert not plane_readable(q6)
    with pytest.raises(ValueError, match="Q6_K"):
        PlaneLinear(q6)
    from slipstream.kernels.pack import fuse_scales

    fused = fuse_scales(planes_of(make_raw(Q.Q4_K, 16, 256, 1), Q.Q4_K, 16, 256))
    assert not plane_readable(fused)  # scales folded into `sm`: not GGUF's
    with pytest.raises(ValueError, match="plane kernel"):
        PlaneLinear(fused)
    with pytest.raises(ValueError, match="plane kernel"):
        plane_nbytes(Q.Q8_0, 16, 256)
    lin = PlaneLinear(planes_of(make_raw(Q.Q4_0, 16, 64, 1), Q.Q4_0, 16, 64))
    with pytest.raises(ValueError, match="float32"):
        lin.matvec(torch.zeros(1, 64, dtype=torch.bfloat16), torch.empty(1, 16))
    with pytest.raises(ValueError, match="8 or 16"):
        lin.matvec(torch.zeros(1, 64), torch.empty(1, 16), act_bits=4)


@pytest.mark.parametrize("bits", [8, 16])
def test_a_nan_or_infinity_in_x_gives_nan(bits):
    lin = PlaneLinear(planes_of(make_raw(Q.Q4_K, 16, 512, 2), Q.Q4_K, 16, 512))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    x[1, 300] = float("nan")
    x[2, 7] = float("inf")
    y = lin.matvec(x, torch.empty(3, 16), act_bits=bits)
    assert bool(torch.isfinite(y[0]).all())
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isnan(y[2]).all())


# --- the split layer's share, read from its image --------------------------------------------

@pytest.fixture(scope="module", params=["Q4_K", "Q4_K_M", "Q4_0"])
def split_image(request, tmp_path_factory):
    """A tiny model's layer 0 split at 256 units by the CUDA builder's packing (run on the CPU,
    as tests/weights/test_flat_layers.py does), flattened into its image."""
    pytest.importorskip("triton")  # QuantLinear looks the kernels up (never runs them here)
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.precision import Precision
    from slipstream.synth import write_synth
    from slipstream.hybrid.ffn import split_layer
    from slipstream.weights.image import to_image
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder, TensorSource

    path = write_synth(tmp_path_factory.mktemp("pl") / "t.gguf", "tiny", request.param,
                       from_floats=True, std=0.05, seed=3)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    cpu = torch.device("cpu")
    builder = LayerBuilder(cfg, cpu, Precision.of("fast", cpu), workspace=Workspace(cpu),
                           fuse_scales=False)
    builder.quantized = True
    src = TensorSource(gf)
    return cfg, src, to_image(split_layer(builder, src, 0, 256), pin=False)


def _dequantized(raw: torch.Tensor, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double().view(rows, cols)


def test_the_cpu_share_read_from_the_image_is_the_ffns_rest(split_image, monkeypatch):
    """host_linears with kind "planes": the rest linears of a Q4_0/Q4_K layer are read from the
    image's bytes (views, no copy, no extra RAM), other formats packed as before; the share
    computes silu(x Wg^T) * (x Wu^T) Wd^T over units [256, ffn) of the GGUF weights."""
    from slipstream.hybrid import ffn as hybrid

    cfg, src, image = split_image
    monkeypatch.setattr(hybrid, "HOST_KIND", "planes")
    raws = hybrid.ffn_raws(src, cfg, 0)
    parts = hybrid.host_linears(raws, 256, image)
    ffn = hybrid.HostFFN(parts["gate_up"], parts["down"], hybrid.HostIO(torch.device("cpu"),
                                                                         cfg.hidden, 8))
    host = image.host
    lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
    for key, name in (("gate_up", "ffn_gate"), ("down", "ffn_down")):
        in_place = raws.qtypes[name] in (Q.Q4_0, Q.Q4_1, Q.Q4_K)
        assert isinstance(parts[key], PlaneLinear) == in_place
        if in_place:
            assert lo <= parts[key].packed.lo.data_ptr() < hi
    assert ffn.extra_ram_bytes == sum(p.nbytes for p in parts.values()
                                      if not isinstance(p, PlaneLinear))
    qg, qd = raws.qtypes["ffn_gate"], raws.qtypes["ffn_down"]
    wg = _dequantized(raws.gate, qg, cfg.ffn, cfg.hidden)[256:]
    wu = _dequantized(raws.up, qg, cfg.ffn, cfg.hidden)[256:]
    wd = _dequantized(raws.down, qd, cfg.hidden, cfg.ffn)[:, 256:]
    x = torch.randn(3, cfg.hidden, generator=torch.Generator().manual_seed(4))
    xd = x.double()
    want = (torch.nn.functional.silu(xd @ wg.t()) * (xd @ wu.t())) @ wd.t()
    got = ffn.compute(x).double()
    rel = float((got - want).norm() / want.norm())
    # 16-bit activations where both are read in place; a Q6_K down (Q4_K_M) goes to int8pack,
    # which requantizes each row (as tests/hybrid/test_hybrid_split.py allows it)
    all_in_place = all(isinstance(p, PlaneLinear) for p in parts.values())
    assert rel < (2e-3 if all_in_place else 2e-2), rel


def test_the_default_kind_still_packs(split_image):
    from slipstream.hybrid import ffn as hybrid

    cfg, src, image = split_image
    if hybrid.HOST_KIND == "planes":
        pytest.skip("SLIPSTREAM_HYBRID_KIND=planes in this environment")
    parts = hybrid.host_linears(hybrid.ffn_raws(src, cfg, 0), 256, image)
    assert not any(isinstance(p, PlaneLinear) for p in parts.values())
    assert dataclasses.is_dataclass(hybrid.HostFFN(parts["gate_up"], parts["down"], None))


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threads_taking_chunks_give_the_bits_of_equal_shares(threads):
    """Threads take the rows in chunks as they finish (as q4vnni's do), not one equal share
    each: every row is still one thread's, computed in one order, so the output is the static
    split's and the single thread's bit for bit, at thread counts that do not divide the rows,
    with more activation rows than one pass over the weights takes."""
    rows, cols = 16 * 70 - 5, 512
    lin = PlaneLinear(planes_of(make_raw(Q.Q4_K, rows, cols, 4), Q.Q4_K, rows, cols))
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(5))
    assert_chunked_threads_give_the_bits(lin, x, rows, threads)
