"""quant.dequantize_as's native pass (native/dequant.c through quant.native) against the torch
reference (quant.dequantize, which test_dequant.py holds to gguf-py's bits) then torch's own
cast: the same float16 and float32 bits for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K, with scales that make float16
overflow to infinity, land in its subnormals and fall exactly halfway between two float16s,
for any thread count; and that the native pass is the one taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from slipstream import native, quant
from slipstream.quant import native as quant_native

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: the torch ops dequantize")

FORMATS = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K]
# where each format's float16 fields sit in its block: d (and m, dmin)
FIELDS = {T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q6_K: (208,)}


def hard_blocks(qtype: T, n: int, seed: int) -> torch.Tensor:
    """(n, type_size) blocks of random codes whose float16 fields span float16's range: tiny
    (subnormal products), huge (products past 65504), ordinary, zero and negative."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    fields = FIELDS.get(qtype, (0,))
    for off in fields:
        exp = rng.integers(-24, 16, n).astype(np.float64)
        v = np.clip(rng.choice([-1.0, 1.0], n) * rng.uniform(1.0, 2.0, n) * 2.0 ** exp,
                    -65504.0, 65504.0)
        v[rng.random(n) < 0.05] = 0.0
        raw[:, off:off + 2] = v.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return torch.from_numpy(raw)


def torch_path(blocks: torch.Tensor, qtype: T, shape, dtype) -> torch.Tensor:
    return quant.dequantize(blocks.reshape(-1), qtype, shape).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.float16 else torch.int32)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_the_native_pass_gives_the_torch_paths_bits(qtype, dtype, monkeypatch):
    blocks = hard_blocks(qtype, 4096, int(qtype))
    shape = (64, 64 * GGML_QUANT_SIZES[qtype][0])
    want = torch_path(blocks, qtype, shape, dtype)
    taken = []
    real = quant_native.dequantize_native
    monkeypatch.setattr(quant, "dequantize_native",
                        lambda *a: taken.append(a[1]) or real(*a))
    got = quant.dequantize_as(blocks.reshape(64, -1), qtype, shape, dtype)
    assert taken == [qtype]  # the native pass served it
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(bits(got), bits(want))
    if dtype == torch.float16:  # the cases the rounding has to get right are in the data
        assert got.isinf().any() and (got != 0).logical_and(got.abs() < 2.0 ** -14).any()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_bits(threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    blocks = hard_blocks(T.Q4_1, 999, 5)
    shape = (27, 37 * 32)
    got = quant_native.dequantize_native(blocks, T.Q4_1, shape, torch.float16)
    assert torch.equal(bits(got), bits(torch_path(blocks, T.Q4_1, shape, torch.float16)))


def test_rounding_to_nearest_even_is_what_is_checked():
    """Negative control: the same float32 values cut to float16 toward zero (a plausible
    wrong conversion) differ from the native pass, so the comparisons above can fail."""
    blocks = hard_blocks(T.Q4_1, 512, 6)
    shape = (16, 32 * 32)
    f32 = quant_native.dequantize_native(blocks, T.Q4_1, shape, torch.float32)
    f16 = quant_native.dequantize_native(blocks, T.Q4_1, shape, torch.float16)
    finite = f32.abs() < 65504
    toward_zero = (f32.view(torch.int32) & ~0x1FFF).view(torch.float32).to(torch.float16)
    assert not torch.equal(bits(f16[finite]), bits(toward_zero[finite]))
    assert torch.equal(bits(f16), bits(f32.to(torch.float16)))


def test_other_formats_and_devices_are_left_to_torch():
    blocks = hard_blocks(T.Q4_0, 4, 7)
    assert quant_native.dequantize_native(blocks, T.Q4_0, (1, 128), torch.bfloat16) is None
    q5 = torch.zeros(4, GGML_QUANT_SIZES[T.Q5_0][1], dtype=torch.uint8)
    assert quant_native.dequantize_native(q5, T.Q5_0, (1, 128), torch.float16) is None
    assert quant_native.dequantize_native(blocks.to("meta"), T.Q4_0, (1, 128),
                                          torch.float16) is None
