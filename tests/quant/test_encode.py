"""The numpy quantizers: layout checked by gguf-py's dequantize, accuracy pinned per format."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from slipstream import quant
from slipstream.errors import BadArgument, GGUFError, UnsupportedTensorType
from slipstream.quant import encode
from slipstream.quant.requantize import parse_type

K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
DELEGATED = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]

# Relative RMS error of dequantize(quantize(x)) on standard gaussian data, upper bounds.
# Measured at the time of writing (seed 0, 64 x 4096): Q8_0 0.54%, Q6_K 1.84%, Q5_1 3.79%,
# Q5_K 3.75%, Q5_0 4.27%, Q4_K 7.56%, Q4_1 7.82%, Q4_0 8.59%, Q3_K 14.9%, Q2_K 28.7%,
# MXFP4 11.5% (gguf-py's: a power-of-two scale and the E2M1 grid), IQ4_NL 7.73%, IQ4_XS 7.77%
# (a non-uniform grid: below Q4_0 at the same bits).
# The bounds leave ~10% headroom, so a regression in the fit shows up here.
MAX_REL_RMS = {
    T.F32: 0.0, T.F16: 5e-4, T.BF16: 3e-3,
    T.Q8_0: 0.006, T.Q6_K: 0.020, T.Q5_K: 0.041, T.Q5_1: 0.042, T.Q5_0: 0.047,
    T.Q4_K: 0.083, T.Q4_1: 0.086, T.Q4_0: 0.095, T.Q3_K: 0.165, T.Q2_K: 0.315,
    T.MXFP4: 0.127, T.IQ4_NL: 0.085, T.IQ4_XS: 0.086,
}
CODEBOOK = [T.IQ4_NL, T.IQ4_XS]  # slipstream's own encoders (quant.encode_codebook)
SUB_BLOCK = {T.Q2_K: 16, T.Q3_K: 16, T.Q4_K: 32, T.Q5_K: 32, T.Q6_K: 16}


def oracle(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's dequantize: checks our packing against code we did not write."""
    return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)


def rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)))


def test_encodable_types() -> None:
    assert encode.encodable_types() == sorted(DELEGATED + K_TYPES + CODEBOOK, key=int)


@pytest.mark.parametrize("qtype", DELEGATED + K_TYPES + CODEBOOK, ids=lambda t: t.name)
def test_round_trip_error(qtype: T) -> None:
    x = np.random.default_rng(0).standard_normal((64, 4096), dtype=np.float32)
    raw = encode.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (64, quant.row_bytes(qtype, 4096))
    y = oracle(raw, qtype, x.shape)
    assert rel_rms(y, x) <= MAX_REL_RMS[qtype]
    # And our torch dequantizer reads the same bytes the same way.
    assert np.array_equal(quant.dequantize(torch.from_numpy(raw), qtype, x.shape).numpy(), y)


@pytest.mark.parametrize("qtype", DELEGATED, ids=lambda t: t.name)
def test_delegated_formats_match_gguf(qtype: T) -> None:
    # quantize() feeds gguf-py whole chunks as one long row; blocks are independent, so the
    # bytes must be exactly what gguf-py gives for the matrix as it is.
    x = np.random.default_rng(1).standard_normal((37, 1024), dtype=np.float32)
    expected = np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8)
    assert np.array_equal(encode.quantize(x, qtype), expected.reshape(37, -1))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_sub_block_scales_track_local_magnitude(qtype: T) -> None:
    # Sub-blocks of one super-block at magnitudes spread over 10x: each must still get close to
    # the nominal error relative to its *own* size, which only per-sub-block scales allow.
    rng = np.random.default_rng(2)
    sub = SUB_BLOCK[qtype]
    x = rng.standard_normal((32 * 1024 // sub, sub), dtype=np.float32)
    x *= (10.0 ** rng.uniform(-1, 0, size=(x.shape[0], 1))).astype(np.float32)
    x = x.reshape(32, 1024)
    y = oracle(encode.quantize(x, qtype), qtype, x.shape)
    err = ((y - x) ** 2).reshape(-1, sub).mean(axis=1) / (x ** 2).reshape(-1, sub).mean(axis=1)
    assert np.sqrt(np.quantile(err, 0.9)) <= 1.4 * MAX_REL_RMS[qtype]


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_chunking_does_not_change_bytes(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((13, 512), dtype=np.float32)
    whole = encode.quantize(x, qtype)
    monkeypatch.setattr(encode, "_CHUNK_ELEMENTS", 3 * 512)  # 3 rows at a time, 5 chunks
    assert np.array_equal(encode.quantize(x, qtype), whole)
    one_by_one = np.concatenate([encode.quantize(row[None], qtype) for row in x])
    assert np.array_equal(one_by_one, whole)


def test_codebook_beats_the_uniform_grid_and_fits_each_group() -> None:
    """IQ4_NL's grid is fitted to bell-shaped weights: at Q4_0's 4.5 bits per weight it must
    do better on Gaussian data; and IQ4_XS's 6-bit group scales must follow groups whose
    magnitudes differ 10x within one 256-element block, as IQ4_NL's separate scales do."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 1024), dtype=np.float32)
    err = {t: rel_rms(oracle(encode.quantize(x, t), t, x.shape), x) for t in (T.Q4_0, T.IQ4_NL)}
    assert err[T.IQ4_NL] < 0.95 * err[T.Q4_0]
    x = x.reshape(-1, 32) * (10.0 ** rng.uniform(-1, 0, size=(512, 1))).astype(np.float32)
    x = x.reshape(16, 1024)
    per_group = {}
    for t in CODEBOOK:
        y = oracle(encode.quantize(x, t), t, x.shape).reshape(-1, 32)
        per_group[t] = np.sqrt(np.mean((y - x.reshape(-1, 32)) ** 2, axis=1)
                               / np.mean(x.reshape(-1, 32) ** 2, axis=1))
    assert np.quantile(per_group[T.IQ4_XS], 0.9) <= 1.2 * np.quantile(per_group[T.IQ4_NL], 0.9)


@pytest.mark.parametrize("qtype", K_TYPES + CODEBOOK, ids=lambda t: t.name)
def test_degenerate_blocks(qtype: T) -> None:
    rng = np.random.default_rng(4)
    rows = [
        np.zeros(512),
        np.full(512, 0.75),
        np.full(512, -0.75),
        np.eye(1, 512, 17)[0] * 3.0,  # a lone spike
        np.where(rng.random(512) < 0.5, 0.0, rng.standard_normal(512)),  # half exact zeros
        1.0 + 0.01 * rng.standard_normal(512),  # all positive, narrow: like a norm weight
    ]
    x = np.stack(rows).astype(np.float32)
    with np.errstate(all="raise"):  # no division by zero or invalid value anywhere
        raw = encode.quantize(x, qtype)
    y = oracle(raw, qtype, x.shape)
    assert np.isfinite(y).all()
    assert np.array_equal(y[0], x[0])  # zeros stay exactly zero
    # Constant rows are representable to f16 precision, whatever the sign.
    np.testing.assert_allclose(y[1:3], x[1:3], rtol=2e-3)
    for i in range(3, len(rows)):
        assert rel_rms(y[i], x[i]) <= MAX_REL_RMS[qtype]


def test_shapes() -> None:
    x = np.random.default_rng(5).standard_normal((2, 3, 256), dtype=np.float32)
    assert encode.quantize(x, T.Q4_K).shape == (2, 3, 144)
    assert encode.quantize(x[0, 0], T.Q6_K).shape == (210,)
    assert encode.quantize(x.astype(np.float64), T.F16).shape == (2, 3, 512)
    assert encode.quantize(np.zeros((0, 256), np.float32), T.Q2_K).shape == (0, 84)
    with pytest.raises(GGUFError, match="300 elements"):
        encode.quantize(np.zeros((2, 300), np.float32), T.Q4_K)


def test_unsupported_types() -> None:
    with pytest.raises(UnsupportedTensorType, match="IQ2_XXS"):
        encode.quantize(np.zeros((1, 256), np.float32), T.IQ2_XXS)
    # `slipstream quantize`'s type: refused by name, with the encodable ones, before anything
    # is read
    with pytest.raises(BadArgument, match="cannot quantize to 'IQ2_XXS'.*IQ4_NL.*MXFP4"):
        parse_type("IQ2_XXS")
    assert GGML_QUANT_SIZES[T.Q4_K] == (256, 144)


def test_requantize_falls_back_where_rows_are_not_whole_blocks(tmp_path):
    """K-quants need rows of 256: without a fallback the encoder refuses a narrower matrix;
    with one, those matrices take the fallback type and the file decodes like its source."""
    from slipstream.errors import SlipstreamError
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.quant.requantize import requantize
    from dataclasses import replace

    from slipstream.synth import SHAPES, write_synth

    shape = replace(SHAPES["tiny"], ffn=320)  # ffn_down's rows: 320 wide, not whole blocks
    src = write_synth(tmp_path / "s.gguf", shape, "Q8_0", n_layers=1, from_floats=True,
                      std=0.1)
    widths = {info.shape[-1] for info in GGUFFile(src).tensors.values() if len(info.shape) > 1}
    assert any(w % 256 for w in widths)
    with pytest.raises(SlipstreamError):
        requantize(src, tmp_path / "bad.gguf", "Q2_K")
    out = GGUFFile(requantize(src, tmp_path / "ok.gguf", "Q2_K", fallback="Q4_0"))
    for name, info in out.tensors.items():
        if len(info.shape) > 1:
            want = "Q2_K" if info.shape[-1] % 256 == 0 else "Q4_0"
            assert info.ggml_type.name == want, name
