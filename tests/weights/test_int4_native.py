"""The native int4 packer (native/int4_pack.c through weights.cpu.native_pack) against torch's own
packing (aten._convert_weight_to_int4pack_for_cpu fed by the torch-op path, int4pack_torch):
the same bytes and the same bfloat16 scales and zeros, for every 4-bit format, stacked parts,
and the rounding cases of the scale and zero. The packed linear's agreement with the GGUF
dequantizer is tests/weights/test_cpu_packed.py's (Int4PackLinear packs natively there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.quant.encode import quantize
from slipstream.weights.cpu.native_pack import FORMATS
from slipstream.weights.cpu.torch_kernels import (Int4PackLinear, int4pack_torch, native_block,
                                                  pack_native)

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: the torch ops pack")


def same_bits(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b))


def encoded(qtype: Q, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A real matrix's GGUF bytes: normal floats with a few outlier rows, quantized by the
    project's encoders (gguf-py's where it has one)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    w[::13] *= 40.0
    return torch.from_numpy(quantize(w, qtype)).reshape(rows, -1)


def test_the_layout_is_torchs_on_this_cpu():
    assert native_block() in (32, 64)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_stacked_parts_equal_torchs_packing(qtype):
    block = native_block()
    parts = [encoded(qtype, 2 * block, 768, 1), encoded(qtype, 3 * block, 768, 2)]
    shapes = [(2 * block, 768), (3 * block, 768)]
    got = pack_native(parts, [qtype, qtype], shapes)
    assert got is not None
    assert same_bits(got, int4pack_torch(parts, [qtype, qtype], shapes))


def test_a_mix_of_formats_in_one_linear():
    block = native_block()
    parts = [encoded(Q.Q4_K, block, 512, 3), encoded(Q.Q4_0, block, 512, 4)]
    shapes = [(block, 512), (block, 512)]
    assert same_bits(pack_native(parts, [Q.Q4_K, Q.Q4_0], shapes),
                     int4pack_torch(parts, [Q.Q4_K, Q.Q4_0], shapes))


def test_threads_do_not_change_the_bytes():
    block = native_block()
    raw = encoded(Q.Q4_K, 8 * block, 512, 5)
    one = pack_native([raw], [Q.Q4_K], [(8 * block, 512)], threads=1)
    four = pack_native([raw], [Q.Q4_K], [(8 * block, 512)], threads=4)
    assert same_bits(one, four)


def test_zeros_round_half_to_even_as_torch_does():
    """Q4_1's zero is 8 d + m: d = 1, m = 1/32 puts it exactly halfway between the bfloat16
    neighbours 8 and 8.0625 (rounded to 8, the even one); d = 1, m = 3/32 between 8.0625 and
    8.125 (to 8.125). Negative scales and zero scales too."""
    block = native_block()
    raw = encoded(Q.Q4_1, block, 256, 6)
    blocks = raw.view(block, 8, 20)
    cases = [(1.0, 1 / 32), (1.0, 3 / 32), (-1.0, -1 / 32), (0.0, 0.0), (-0.0, 0.5),
             (2.0 ** -24, 1.0), (65504.0, -65504.0), (0.1, 0.3)]
    for g, (d, m) in enumerate(cases):
        blocks[:, g, 0:2] = torch.tensor([d], dtype=torch.float16).view(torch.uint8)
        blocks[:, g, 2:4] = torch.tensor([m], dtype=torch.float16).view(torch.uint8)
    got = pack_native([raw], [Q.Q4_1], [(block, 256)])
    assert same_bits(got, int4pack_torch([raw], [Q.Q4_1], [(block, 256)]))
    zeros = got[1][:, 0, 1].float()
    assert zeros[0].item() == 8.0 and zeros[1].item() == 8.125


def test_rows_not_in_whole_blocks_go_to_the_torch_ops():
    block = native_block()
    raw = encoded(Q.Q4_K, block + 16, 256, 7)
    assert pack_native([raw], [Q.Q4_K], [(block + 16, 256)]) is None
    assert pack_native([encoded(Q.Q8_0, block, 256, 8)], [Q.Q8_0], [(block, 256)]) is None
    lin = Int4PackLinear.from_raws([raw], [Q.Q4_K], [(block + 16, 256)])  # still packs
    assert same_bits((lin.packed, lin.scale_zeros),
                     int4pack_torch([raw], [Q.Q4_K], [(block + 16, 256)]))


def test_the_check_outlives_the_library_turned_off(monkeypatch):
    """A packing while SLIPSTREAM_NATIVE=0 (the torch ops) must not leave the native packer
    off once the library is back (CI: test_cpu_native's off switch ran first in a worker)."""
    monkeypatch.setenv("SLIPSTREAM_NATIVE", "0")
    native.library.cache_clear()
    try:
        raw = encoded(Q.Q4_K, 64, 256, 9)
        assert pack_native([raw], [Q.Q4_K], [(64, 256)]) is None
    finally:
        monkeypatch.delenv("SLIPSTREAM_NATIVE")
        native.library.cache_clear()
    assert native_block() in (32, 64)
