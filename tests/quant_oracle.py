"""The native 4-bit kernel's oracle pieces, shared by its tests (tests/weights/test_q4vnni.py):
random GGUF bytes of a format, and the activations as the C quantizes them (native/
q4_matvec.c's ss_q16_quantize_row), in float64."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.synth import random_tensor


def make_raw(qtype: Q, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng([int(qtype), rows, cols, seed])
    return torch.from_numpy(random_tensor(qtype, (rows, cols), rng, 0.02)).view(rows, -1)


def quantize16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C's 16-bit quantization of float32 rows x: (X int32 (m, k) = 256 hi + lo, dx)."""
    lib = native.library()
    m, k = x.shape
    hi, lo = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k, dtype=torch.int8)
    dx, sx = torch.empty(m, k // 32), torch.empty(m, k // 32)
    x = x.contiguous()
    for r in range(m):
        lib.ss_q16_quantize_row(x[r].data_ptr(), k, hi[r].data_ptr(), lo[r].data_ptr(),
                                dx[r].data_ptr(), sx[r].data_ptr())
    X = 256 * hi.to(torch.int32) + lo.to(torch.int32)
    assert torch.equal(sx, dx * X.view(m, -1, 32).sum(-1).float())
    return X, dx


def quantized(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel sees them, float64 (m, k): dx X (X = 256 hi + lo)."""
    m, k = x.shape
    X, dx = quantize16_rows(x)
    return (X.double().view(m, -1, 32) * dx.double()[..., None]).view(m, k)


def assert_within_bound(y: torch.Tensor, y_ref: torch.Tensor, bound: torch.Tensor,
                        what: str) -> None:
    """Every output of the kernel (y) within its rounding bound of the float64 oracle."""
    err = (y.double() - y_ref).abs()
    assert bool((err <= bound * (1 + 1e-6) + 1e-30).all()), (
        f"{what}: off by {(err / (bound + 1e-30)).max():.3f} of the rounding bound")


def assert_same_bits_every_way(lin, x: torch.Tensor, rows: int) -> None:
    """lin.matvec gives the same bits at 1 and 2 threads, through the vector loop and the
    plain-C one, and a row of x the same bits alone as beside the others of its call."""
    m = x.shape[0]
    ys = [lin.matvec(x, torch.empty(m, rows), threads=t, generic=gen)
          for t in (1, 2) for gen in (False, True)]
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    for r in range(m):
        one = lin.matvec(x[r:r + 1], torch.empty(1, rows), threads=2)
        assert torch.equal(one, ys[0][r:r + 1])


def assert_chunked_threads_give_the_bits(lin, x: torch.Tensor, rows: int, threads: int) -> None:
    """lin.matvec at `threads` (the threads taking chunks of the rows as they finish) gives the
    single thread's bits."""
    m = x.shape[0]
    one = lin.matvec(x, torch.empty(m, rows), threads=1)
    y = lin.matvec(x, torch.empty(m, rows), threads=threads)
    assert torch.equal(y.view(torch.int32), one.view(torch.int32))


def assert_bfloat16_in_and_out(lin, rows: int, cols: int) -> None:
    """kernel(): bfloat16 rows in (widened exactly), bfloat16 out = the float32 result rounded
    to nearest even, as torch rounds."""
    xb = torch.randn(2, cols, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y32 = lin.matvec(xb.float(), torch.empty(2, rows))
    assert torch.equal(lin.matvec(xb, torch.empty(2, rows)), y32)
    yb = lin.kernel(xb)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, rows)
    assert torch.equal(yb, y32.to(torch.bfloat16))


def q6vnni_bound(ga, xd: torch.Tensor) -> torch.Tensor:
    """A priori |y - x w^T| of q6vnni (weights.cpu.q6vnni) for float64 x (m, K) and Q6_K's
    GroupAffine `ga`: x quantized to 16 bits per block of 32 (|dx X - x| <= dx / 2, plus
    float32's rounding of dx and x / dx: the factor 1 + 2^-20), then per 16-column sub-block
    an exact integer sum, a product and a multiply-add: (K / 16 + 1) 2^-24 sum |w| |x'|."""
    w = ga.exact()
    dx = xd.abs().view(xd.shape[0], -1, 32).amax(-1) / 32512
    dxe = (dx / 2 * (1 + 2.0 ** -20))[..., None].expand(-1, -1, 32).reshape(xd.shape)
    return dxe @ w.abs().t() + (ga.shape[1] // 16 + 1) * 2.0 ** -24 * (
        (xd.abs() + dxe) @ w.abs().t())


def assert_native_expert_sum(gu_q: Q, dn_q: Q, hidden: int, units: int, k: int,
                             monkeypatch) -> None:
    """A token's k experts (gate/up in gu_q, down in dn_q) in moe_ffn.c's one call, the
    op-by-op loop made to fail: within 1e-3 of the float64 sum of gguf-py's weights (the 16-bit
    activations' error, twice, and float32 sums), the same bits on one thread as on the
    caller's; the experts' order swapped misses it."""
    import gguf.quants

    from slipstream.weights.cpu import PackedDecodeLinear, pack_linear
    from helpers import refuse_expert_loop
    from slipstream.weights.cpu.expert_decode import native_expert_sum

    experts, ws = [], []
    for e in range(k):
        gu_raw = make_raw(gu_q, 2 * units, hidden, 20 + e)
        dn_raw = make_raw(dn_q, hidden, units, 30 + e)
        experts.append((PackedDecodeLinear.decode_only(
                            pack_linear(gu_raw, gu_q, (2 * units, hidden)), 8),
                        PackedDecodeLinear.decode_only(
                            pack_linear(dn_raw, dn_q, (hidden, units)), 8)))
        ws.append([torch.from_numpy(gguf.quants.dequantize(r.numpy(), t)).double()
                   for r, t in ((gu_raw, gu_q), (dn_raw, dn_q))])
    g = torch.Generator().manual_seed(11)
    h = torch.randn(1, hidden, generator=g) * 20
    weights = torch.softmax(torch.randn(k, generator=g), 0)
    ref = torch.zeros(hidden, dtype=torch.float64)
    for (gu, dn), wt in zip(ws, weights.double()):
        a = gu @ h.double()[0]
        ref += wt * (dn @ (torch.nn.functional.silu(a[:units]) * a[units:]))

    refuse_expert_loop(monkeypatch)
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
