"""The torch reference dequantizers against gguf-py's numpy ones, bit for bit."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from slipstream import quant
from slipstream.errors import GGUFError, UnsupportedTensorType
from slipstream.quant import encode

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
FLOAT_TYPES = {T.F32, T.F16, T.BF16}
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

# Byte offsets of each block's f16 scale fields, written down here from ggml-common.h rather
# than taken from the package, so a layout mistake there cannot hide itself.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}
# MXFP4's one-byte e8m0 scale: 2^(e - 128) times codes up to 12, so e above 252 overflows
E8M0_FIELDS = {T.MXFP4: (0,)}


def assert_bit_identical(got: torch.Tensor | np.ndarray, ref: np.ndarray) -> None:
    """Same shape, float32, NaN in the same places, and the same bits everywhere else."""
    got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
    assert got.dtype == np.float32 and ref.dtype == np.float32
    assert got.shape == ref.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    # Comparing the int32 views also tells -0.0 from 0.0, which == would not.
    assert np.array_equal(got.view(np.int32)[~nan], ref.view(np.int32)[~nan])


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(n_blocks, type_size) random bytes, with every f16 scale field a finite value.

    Float types keep fully random bits (NaN, inf and subnormals included): their conversion has
    to agree on those too. The scales mix signs, zeros, subnormals and large values.
    """
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, ()):
        scale = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 3, n_blocks)
        scale[rng.random(n_blocks) < 0.1] = 0.0
        raw[:, offset:offset + 2] = scale.astype(np.float16).reshape(-1, 1).view(np.uint8)
    for offset in E8M0_FIELDS.get(qtype, ()):
        # the subnormal scales 0 and 1, the unit scale 127 and the largest safe one, among
        # random ones
        e = rng.integers(0, 253, n_blocks)
        e[:4] = (0, 1, 127, 252)[:n_blocks]
        raw[:, offset] = e
    return raw


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    """gguf-py's dequantize of (rows, row_bytes) bytes, as float32 (rows, cols)."""
    out = gguf.quants.dequantize(raw, qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 7, 129])
def test_random_blocks_match_gguf(qtype: T, n_blocks: int) -> None:
    rng = np.random.default_rng([int(qtype), n_blocks])
    raw = random_blocks(qtype, n_blocks, rng)
    ref = reference(raw, qtype)
    if qtype not in FLOAT_TYPES:  # sane scales give finite values, so NaN cannot mask a mismatch
        assert np.isfinite(ref).all()
    assert_bit_identical(quant.get_format(qtype).dequantize_blocks(torch.from_numpy(raw)), ref)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_whole_tensor_1d_and_2d_bytes(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 3, 5
    raw = random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, blocks_per_row * type_size)
    ref = reference(raw, qtype)  # (rows, cols)
    shape = (rows, blocks_per_row * block_size)
    assert_bit_identical(quant.dequantize(torch.from_numpy(raw), qtype, shape), ref)
    assert_bit_identical(quant.dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype), shape), ref)
    # A 3-d tensor (as stacked experts would be) is rows of rows.
    got = quant.dequantize(torch.from_numpy(raw), qtype, (rows, 1, shape[1]))
    assert_bit_identical(got, ref.reshape(rows, 1, -1))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_unaligned_bytes(qtype: T, n_blocks: int) -> None:
    # Bytes sliced out of a file buffer at an odd offset: dtype views must not trip on it.
    rng = np.random.default_rng(7)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, n_blocks, rng)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw.reshape(-1))
    got = quant.dequantize(buf[1:], qtype, (n_blocks * block_size,))
    assert_bit_identical(got, reference(raw.reshape(1, -1), qtype).reshape(-1))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0],
                         ids=lambda t: t.name)
def test_gguf_quantized_data(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((17, 288), dtype=np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(17, -1)
    got = quant.dequantize(torch.from_numpy(raw), qtype, x.shape)
    assert_bit_identical(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_encoded_data(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    # Per-row magnitudes spread over 4 decades so the packed scales see a range of values.
    x = rng.standard_normal((33, 768), dtype=np.float32)
    x *= (10.0 ** rng.uniform(-3, 1, size=(33, 1))).astype(np.float32)
    raw = encode.quantize(x, qtype)
    got = quant.dequantize(torch.from_numpy(raw), qtype, x.shape)
    assert_bit_identical(got, reference(raw, qtype))


@pytest.mark.slow
def test_real_model_tensors(smollm_path) -> None:
    reader = gguf.GGUFReader(smollm_path)
    by_type: dict[T, list] = {}
    for tensor in reader.tensors:
        by_type.setdefault(T(tensor.tensor_type), []).append(tensor)
    assert {T.Q4_1, T.Q8_0, T.F32} <= set(by_type)
    picked = by_type[T.Q4_1][:3] + by_type[T.Q8_0][:1] + by_type[T.F32][:2]
    for tensor in picked:
        qtype = T(tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF ne order -> torch order
        raw = np.array(tensor.data).view(np.uint8)  # a writable copy of the mmap'd bytes
        if qtype == T.Q8_0:  # the 49152-row embedding: its first 2048 rows are plenty
            raw, shape = raw[:2048], (2048, *shape[1:])
        raw = raw.reshape(shape[0] if len(shape) > 1 else 1, -1)
        got = quant.dequantize(torch.from_numpy(raw), qtype, shape)
        assert_bit_identical(got, reference(raw, qtype).reshape(shape))


def test_registry_and_row_bytes() -> None:
    grid_types = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
    assert quant.supported_types() == sorted(ALL_TYPES + grid_types, key=int)
    for qtype in ALL_TYPES:
        fmt = quant.get_format(qtype)
        assert fmt is quant.get_format(int(qtype))
        assert (fmt.qtype, fmt.name) == (qtype, qtype.name)
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[qtype]
    assert quant.row_bytes(T.Q4_K, 4096) == 16 * 144
    assert quant.row_bytes(T.Q8_0, 576) == 18 * 34
    assert quant.row_bytes(T.F16, 7) == 14
    with pytest.raises(GGUFError, match="576"):
        quant.row_bytes(T.Q4_K, 576)


def test_unsupported_type_is_named() -> None:
    with pytest.raises(UnsupportedTensorType, match=r"TQ1_0 is not supported; supported: F32, F16"):
        quant.get_format(T.TQ1_0)
    with pytest.raises(UnsupportedTensorType, match="TQ2_0"):
        quant.dequantize(torch.zeros(66, dtype=torch.uint8), int(T.TQ2_0), (256,))
    with pytest.raises(UnsupportedTensorType, match="9999"):
        quant.get_format(9999)


def test_byte_count_mismatch() -> None:
    raw = torch.zeros(2 * 34 + 1, dtype=torch.uint8)
    with pytest.raises(GGUFError, match=r"needs 68 bytes, got 69"):
        quant.dequantize(raw, T.Q8_0, (2, 32))
    with pytest.raises(GGUFError, match=r"needs 136 bytes, got 69"):
        quant.dequantize(raw, T.Q8_0, (4, 32))
    with pytest.raises(GGUFError, match="33 elements"):
        quant.dequantize(raw, T.Q8_0, (2, 33))
    with pytest.raises(GGUFError, match="uint8"):
        quant.dequantize(torch.zeros(8, dtype=torch.int32), T.F32, (8,))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    block_size = GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(random_blocks(qtype, 1001, rng))
    shape = (7, 143 * block_size)
    cpu = quant.dequantize(raw, qtype, shape)
    cuda = quant.dequantize(raw.cuda(), qtype, shape)
    assert cuda.device.type == "cuda" and cuda.dtype == torch.float32
    assert_bit_identical(cuda, cpu.numpy())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_dequantize_as_is_dequantize_then_to(qtype: T, dtype: torch.dtype, monkeypatch) -> None:
    """dequantize_as narrows chunk by chunk (here 3 blocks a chunk, so a tensor spans several
    and ends in a short one, at an odd byte offset): the same bits as the whole tensor
    dequantized and then narrowed, and the same errors."""
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 3 * GGML_QUANT_SIZES[qtype][0])
    rng = np.random.default_rng([int(qtype), 11])
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 4, 5
    raw = random_blocks(qtype, rows * blocks_per_row, rng).reshape(-1)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw)
    shape = (rows, blocks_per_row * block_size)
    want = quant.dequantize(buf[1:], qtype, shape).to(dtype)
    got = quant.dequantize_as(buf[1:], qtype, shape, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))  # NaN payloads and -0.0 included
    with pytest.raises(GGUFError, match="needs"):
        quant.dequantize_as(buf[1:-1], qtype, shape, dtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_dequantize_as_writes_into_a_given_tensor(qtype: T, dtype: torch.dtype) -> None:
    """out=: the same bits, in the caller's tensor (a fused weight's rows: a view of a larger
    one), and returned; a tensor of another shape or dtype is refused."""
    rng = np.random.default_rng([int(qtype), 12])
    block_size = GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(random_blocks(qtype, 3 * 4, rng).reshape(3, -1))
    shape = (3, 4 * block_size)
    want = quant.dequantize_as(raw, qtype, shape, dtype)
    whole = torch.full((5, shape[1]), 7.0, dtype=dtype)
    got = quant.dequantize_as(raw, qtype, shape, dtype, out=whole[1:4])
    assert got.data_ptr() == whole[1].data_ptr()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(whole[1:4].view(bits), want.view(bits))
    assert whole[0].eq(7).all() and whole[4].eq(7).all()  # only its rows were written
    with pytest.raises(ValueError, match="out must be"):
        quant.dequantize_as(raw, qtype, shape, dtype, out=torch.empty(shape, dtype=torch.bfloat16))
