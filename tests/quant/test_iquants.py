"""The i-quant grid dequantizers against gguf-py's numpy ones and llama.cpp's C ones.

Bit for bit, not to a tolerance: gguf-py, ggml's dequantize_row_* and slipstream take the
same float32 steps in the same order (widen the f16 scale, scale it by the sub-block's small
integer, multiply by the grid value, then by the sign; IQ1: add the shift, then scale), each
rounded once, and grid values, signs and shifts are exact in float32. Every block's bytes are
random: every grid index, sign index and scale field of these formats is valid, so random
codes exercise the whole tables.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from slipstream import quant

GRID_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]

# IQ1_M keeps its f16 d in the top nibbles of the four 16-bit words at bytes 48..55 (nibble k
# in word k); the others keep it at byte 0. Written down from ggml-common.h, not taken from the
# package, so a layout mistake there cannot hide itself.
IQ1_M_SCALE_WORDS = 48


def set_scale(raw: np.ndarray, qtype: T, d: np.ndarray) -> None:
    """Write the f16 super-block scale `d` (one per block) into random blocks, in place."""
    bits16 = d.astype(np.float16).view(np.uint16)
    if qtype != T.IQ1_M:
        raw[:, 0:2] = bits16.reshape(-1, 1).view(np.uint8)
        return
    for k in range(4):  # the high byte of word k holds nibble k of d in its top half
        at = IQ1_M_SCALE_WORDS + 2 * k + 1
        raw[:, at] = (raw[:, at] & 0x0F) | ((((bits16 >> (4 * k)) & 0x0F) << 4).astype(np.uint8))


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes whose f16 scales are finite and mix signs, zeros, subnormals and large
    values."""
    raw = rng.integers(0, 256, size=(n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    d = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 3, n_blocks)
    d[rng.random(n_blocks) < 0.1] = 0.0
    set_scale(raw, qtype, d)
    return raw


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    return np.ascontiguousarray(gguf.quants.dequantize(raw, qtype),
                                dtype=np.float32).reshape(raw.shape[0], -1)


def ours(raw: np.ndarray, qtype: T) -> np.ndarray:
    return quant.get_format(qtype).dequantize_blocks(torch.from_numpy(raw)).numpy()


def _ggml_base() -> ctypes.CDLL | None:
    """The libggml-base that llama-cpp-python ships, or None without it."""
    try:
        import llama_cpp
    except ImportError:
        return None
    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    return ctypes.CDLL(str(libs[0])) if libs else None


GGML = _ggml_base()


def ggml_dequantize(raw: np.ndarray, qtype: T) -> np.ndarray:
    """llama.cpp's own C dequantizer (ggml's dequantize_row_*) of (n_blocks, type_size)
    bytes: a second reference, sharing no code with gguf-py's numpy."""
    if GGML is None:
        pytest.skip("llama-cpp-python (and its libggml-base) is not installed")
    fn = getattr(GGML, f"dequantize_row_{qtype.name.lower()}")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], 256), dtype=np.float32)
    fn(raw.ctypes.data, out.ctypes.data, out.size)
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as float32 bit patterns (so -0.0 is told from 0.0)."""
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 7, 129])
def test_random_blocks_match_gguf(qtype: T, n_blocks: int) -> None:
    rng = np.random.default_rng([int(qtype), n_blocks])
    raw = random_blocks(qtype, n_blocks, rng)
    ref = reference(raw, qtype)
    assert np.isfinite(ref).all()  # sane scales: NaN cannot hide a mismatch
    if n_blocks > 1:  # (one block may draw a zero scale)
        assert np.count_nonzero(ref) > ref.size // 2
    assert same_bits(ours(raw, qtype), ref)


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_ggml(qtype: T) -> None:
    """The same bits as llama.cpp's C code: it multiplies in the same order (d by the small
    scale, by the grid value, by the sign; IQ1: the shifted grid value by the scale)."""
    rng = np.random.default_rng([int(qtype), 2])
    raw = random_blocks(qtype, 65, rng)
    assert same_bits(ours(raw, qtype), ggml_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_registered_with_ggml_sizes(qtype: T) -> None:
    fmt = quant.get_format(qtype)
    assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[qtype] and fmt.block_size == 256
    assert qtype in quant.supported_types()


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_whole_tensor_at_an_odd_offset_and_narrowed(qtype: T, monkeypatch) -> None:
    """Through quant.dequantize and dequantize_as (chunked: 2 blocks a chunk, so the tensor
    spans several chunks and ends in a short one), from bytes at an odd address."""
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 2 * 256)
    rng = np.random.default_rng([int(qtype), 3])
    rows, per_row = 3, 5
    raw = random_blocks(qtype, rows * per_row, rng)
    ref = reference(raw, qtype).reshape(rows, per_row * 256)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw.reshape(-1))
    shape = (rows, per_row * 256)
    assert same_bits(quant.dequantize(buf[1:], qtype, shape).numpy(), ref)
    half = quant.dequantize_as(buf[1:], qtype, shape, torch.float16)
    assert torch.equal(half, torch.from_numpy(ref).to(torch.float16))


# One deliberate change per format: (byte, bit) to flip in block 0, and what it must do to the
# 256 weights, from ggml-common.h / dequantize_row_* in ggml-quants.c:
#   "negate": these weights change sign, nothing else moves;
#   "shift":  these weights move by -2 * delta * their scale (the IQ1 shift's sign flips).
FLIPS: dict[T, tuple[int, int, str, list[int]]] = {
    # sign index bit 0 of the first group: ksigns[i] and ksigns[i ^ 1] differ in bit 0 and in
    # the parity bit 7, so weights 0 and 7 change sign
    T.IQ2_XXS: (2 + 4, 0, "negate", [0, 7]),
    T.IQ2_XS: (2 + 1, 1, "negate", [0, 7]),  # bit 9 of qs[0]: its sign index's bit 0
    T.IQ2_S: (34 + 1, 3, "negate", [11]),  # sign byte 1, bit 3: weight 8 + 3
    T.IQ3_XXS: (66, 0, "negate", [0, 7]),  # sub-block 0's word, sign index 0, bit 0
    T.IQ3_S: (74 + 4, 5, "negate", [37]),  # sign byte 4, bit 5: weight 32 + 5
    T.IQ1_S: (34 + 2 * 1 + 1, 7, "shift", list(range(32, 64))),  # qh[1] bit 15: sub-block 1
    T.IQ1_M: (32 + 1, 7, "shift", list(range(24, 32))),  # qh byte 1, high nibble: point 3
}


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_a_flipped_bit_moves_exactly_the_weights_it_should(qtype: T) -> None:
    """Negative control: the comparison above fails for changed bytes, and the change lands
    where the layout says, as gguf-py sees it too."""
    at, bit, kind, where = FLIPS[qtype]
    rng = np.random.default_rng([int(qtype), 5])
    raw = random_blocks(qtype, 4, rng)
    set_scale(raw, qtype, rng.uniform(0.5, 2.0, 4))  # no zero scale to hide a change
    flipped = raw.copy()
    flipped[0, at] ^= 1 << bit
    before, after = ours(raw, qtype), ours(flipped, qtype)
    assert not same_bits(after, reference(raw, qtype))
    assert same_bits(after, reference(flipped, qtype))
    if GGML is not None:
        assert same_bits(after, ggml_dequantize(flipped, qtype))
    moved = np.flatnonzero(before[0] != after[0]).tolist()
    assert moved == where
    assert np.array_equal(before[1:], after[1:])
    if kind == "negate":
        assert np.array_equal(after[0, where], -before[0, where])
    else:  # every weight of the group moved by the same amount, 2 * delta * scale
        step = after[0, where] - before[0, where]
        assert np.allclose(step, step[0], rtol=1e-5, atol=0) and step[0] != 0


def test_grids_come_from_gguf_and_are_built_once() -> None:
    from slipstream.quant import iquants

    got = iquants._table("IQ3_S", torch.device("cpu"))
    assert got is iquants._table("IQ3_S", torch.device("cpu"))
    assert got.shape == (512, 4) and got.dtype == torch.float32
    # IQ3_S's points are odd values 1 .. 15 (ggml-common.h: iq3s_grid)
    assert set(got.unique().tolist()) <= {1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0}
    signs = iquants._table("ksigns", torch.device("cpu"))
    # ksigns[i]: the 7 bits of i plus a parity bit that makes the count of set bits even
    parity = [bin(i).count("1") % 2 for i in range(128)]
    assert signs.tolist() == [i | (p << 7) for i, p in enumerate(parity)]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = torch.from_numpy(random_blocks(qtype, 1001, rng))
    shape = (7, 143 * 256)
    cpu = quant.dequantize(raw, qtype, shape)
    cuda = quant.dequantize(raw.cuda(), qtype, shape)
    assert cuda.device.type == "cuda"
    assert same_bits(cuda.cpu().numpy(), cpu.numpy())
