"""The i-quant grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) through the
GPU path: pack_weight's planes, the dequant kernel, the float32 GEMV and the routed GEMV,
against gguf-py's dequantizer (gguf.quants.dequantize) in float64.

Blocks are random bytes with a finite f16 scale: every grid index, sign index and scale field
of these formats is valid, so random codes reach the whole grids and sign tables.

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs the kernel checks in Triton's
interpreter; the whole-model check needs CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import gguf.quants
import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from slipstream import kernels  # noqa: E402
from slipstream.kernels import gemv_q8, pack  # noqa: E402
from slipstream.memory.vram import packed_planes  # noqa: E402

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

gemv_iq = importlib.import_module("slipstream.kernels.gemv_iq")
DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GRID_TYPES = [T.IQ3_XXS, T.IQ2_XXS, T.IQ3_S, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M]

# The fused float32 GEMV: exact weights times float32 x, float32 sums (the bound of
# tests/gpu/test_kernels.py for every format); a bfloat16 result adds its rounding (2^-9).
FP32_TOL = 2e-6
BF16_OUT_TOL = 8e-3
# matmul above the GEMV's rows: the weights rounded to bfloat16 for cuBLAS (2^-9 each)
BF16_W_TOL = 1e-2
# IQ1_M's f16 d lies in four nibbles of its scale words in GGUF; the planes keep it whole
IQ1_M_D_WORDS = 48  # byte offset of those words (ggml-common.h block_iq1_m)


def _raw(qt: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, k / 256 * type_size) random blocks whose f16 d is in +-[1e-3, 1e-2]."""
    nb = n * k // 256
    raw = rng.integers(0, 256, size=(nb, GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)
    d = (rng.uniform(1e-3, 1e-2, nb) * rng.choice([-1, 1], nb)).astype(np.float16)
    bits16 = d.view(np.uint16)
    if qt == T.IQ1_M:  # nibble j of d in the top nibble of scale word j
        for j in range(4):
            at = IQ1_M_D_WORDS + 2 * j + 1
            raw[:, at] = (raw[:, at] & 0x0F) | (((bits16 >> (4 * j)) & 0x0F) << 4).astype(
                np.uint8)
    else:
        raw[:, 0:2] = bits16.reshape(-1, 1).view(np.uint8)
    return raw.reshape(n, -1)


def _setup(qt: T, n: int, k: int, seed: int):
    raw = _raw(qt, n, k, np.random.default_rng(seed))
    ref = np.asarray(gguf.quants.dequantize(raw.reshape(-1), qt), dtype=np.float64)
    packed = kernels.pack_weight(torch.from_numpy(raw).to(DEVICE), qt, n, k)
    return packed, ref.reshape(n, k)


def _rel(y: torch.Tensor, ref: np.ndarray) -> float:
    y = y.double().cpu().numpy()
    assert np.isfinite(y).all(), "non-finite output"
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("qt", GRID_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(qt: T) -> None:
    """Dequant to float32 equals gguf-py exactly (every weight is exact in float32, see
    gemv_iq.py); to 16 bits, gguf-py's rounded once (float16 in the interpreter, whose bfloat16
    conversion truncates instead of rounding to nearest)."""
    n, k = 5, 256 * 3
    packed, ref = _setup(qt, n, k, seed=3)
    assert pack.QSPECS[qt].iq and not pack.QSPECS[qt].int_codes
    w32 = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
    assert np.array_equal(w32, ref)
    half = torch.float16 if INTERPRET else torch.bfloat16
    w16 = kernels.dequantize(packed, half).float().cpu()
    assert torch.equal(w16, torch.from_numpy(ref).float().to(half).float())


@pytest.mark.parametrize("qt", GRID_TYPES, ids=lambda t: t.name)
def test_planes_keep_gguf_size(qt: T) -> None:
    """The planes hold GGUF's bytes (IQ1_M: + its d, 2 bytes a block), as the VRAM planner
    counts them; a row slice is the same rows of the weight."""
    n, k = 7, 512
    packed, ref = _setup(qt, n, k, seed=2)
    extra = 2 * n * k // 256 if qt == T.IQ1_M else 0
    assert packed.nbytes == packed.gguf_bytes + extra
    got = sorted(p.numel() * p.element_size() for p in (packed.lo, packed.hi, packed.d,
                                                         packed.sc, packed.mn) if p is not None)
    assert got == sorted(packed_planes(qt, n, k)) == sorted(packed_planes(qt, n, k, True))
    part = kernels.dequantize(packed.row_slice(2, 5), torch.float32).double().cpu().numpy()
    assert np.array_equal(part, ref[2:5])


@pytest.mark.parametrize("qt", GRID_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 7])
def test_gemv_matches_reference(qt: T, n: int) -> None:
    k = 256 * 2
    packed, ref = _setup(qt, n, k, seed=n)
    for m in (1, 2, 3, 4, 8):
        x = torch.randn(m, k).to(torch.bfloat16).to(DEVICE)
        yref = x.double().cpu().numpy() @ ref.T
        out = torch.full((m, n), float("nan"), device=DEVICE)  # poison: every element written
        kernels.gemv(x, packed, out=out)
        assert _rel(out, yref) <= FP32_TOL, (qt.name, n, m)
    ybf = kernels.gemv(x, packed)
    assert ybf.dtype == torch.bfloat16
    assert _rel(ybf, yref) <= BF16_OUT_TOL, (qt.name, n)


@pytest.mark.parametrize("qt", [T.IQ3_XXS, T.IQ2_XXS, T.IQ1_M], ids=lambda t: t.name)
def test_gemv_tiles(qt: T) -> None:
    """Tiles with tails in N and several steps along K (BK below a super-block too), for the
    decode kernel (m = 1) and the one for more rows."""
    k, n = 256 * 3, 9
    packed, ref = _setup(qt, n, k, seed=7)
    x = torch.randn(3, k).to(torch.float16).to(DEVICE)
    yref = x.double().cpu().numpy() @ ref.T
    for m in (1, 3):
        for cfg in [{"BN": 1, "BK": 64}, {"BN": 4, "BK": 128}, {"BN": 16, "BK": 256}]:
            y = kernels.gemv(x[:m], packed, out_dtype=torch.float32,
                             config=dict(cfg, num_warps=4))
            assert _rel(y, yref[:m]) <= FP32_TOL, (qt.name, m, cfg)


@pytest.mark.parametrize("qt", [T.IQ3_XXS, T.IQ2_XXS, T.IQ3_S, T.IQ1_S], ids=lambda t: t.name)
def test_gemv_routed(qt: T) -> None:
    """Each (token, slot)'s expert from a stack of 3 experts of 5 rows: tokens' slots share
    their x row (x_div = 2), and each pair its own (x_div = 1)."""
    n_exp, n, k = 3, 5, 512
    packed, ref = _setup(qt, n_exp * n, k, seed=11)
    ids = torch.tensor([2, 0, 1, 2, 0, 0], dtype=torch.int32)
    for x_div in (2, 1):
        x = torch.randn(6 // x_div, k).to(DEVICE)
        y = kernels.gemv_routed(x, packed, ids.to(DEVICE), n_exp, x_div,
                                out_dtype=torch.float32)
        xs = x.double().cpu().numpy()
        yref = np.stack([xs[p // x_div] @ ref[e * n:(e + 1) * n].T
                         for p, e in enumerate(ids.tolist())])
        assert y.shape == (6, n)
        assert _rel(y, yref) <= FP32_TOL, (qt.name, x_div)


@pytest.mark.parametrize("qt", [T.IQ2_XXS, T.IQ3_S], ids=lambda t: t.name)
def test_matmul_above_the_gemv_dequantizes(qt: T) -> None:
    """More than 8 rows: qgemm and the int8-activation GEMV read integer codes, not grids, so
    matmul dequantizes and multiplies."""
    k, n, m = 512, 6, 12
    packed, ref = _setup(qt, n, k, seed=5)
    assert not kernels.qgemm_supports(packed) and not gemv_q8.supports(packed)
    x = torch.randn(m, k).to(torch.bfloat16).to(DEVICE)
    y = kernels.matmul(x, packed)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, x.double().cpu().numpy() @ ref.T) <= BF16_W_TOL


def test_wrong_grid_or_lost_plane_fails(monkeypatch) -> None:
    """Negative controls: the kernels gathering from a grid with its points shuffled, or an
    IQ2_XXS weight whose sign/scale words read as zero, must miss gguf-py by far."""
    qt, k = T.IQ2_XXS, 512
    packed, ref = _setup(qt, 3, k, seed=1)
    x = torch.randn(1, k).to(DEVICE)
    yref = x.double().cpu().numpy() @ ref.T
    right = gemv_iq.grid_words(qt, packed.device)
    shuffled = right[torch.randperm(right.shape[0], generator=torch.Generator().manual_seed(0))
                     .to(right.device)].contiguous()
    with monkeypatch.context() as mp:
        mp.setattr(gemv_iq, "grid_words", lambda qtype, device: shuffled)
        assert _rel(kernels.gemv(x, packed, out_dtype=torch.float32), yref) > 0.1
        w = kernels.dequantize(packed, torch.float32).double().cpu().numpy()
        assert not np.array_equal(w, ref)
    zeroed = dataclasses.replace(packed, hi=torch.zeros_like(packed.hi))
    assert _rel(kernels.gemv(x, zeroed, out_dtype=torch.float32), yref) > 0.1
    assert _rel(kernels.gemv(x, packed, out_dtype=torch.float32), yref) <= FP32_TOL


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_quant_linear_routes_grid_weights(precision: str) -> None:
    """A layer's QuantLinear: "fast" keeps the float32 GEMV for these formats (no int8
    activations), and above the GEMV's rows "exact" multiplies float32 dequantized rows."""
    from slipstream.weights.linear import QuantLinear, Workspace

    qt, k, n = T.IQ3_XXS, 512, 24
    packed, ref = _setup(qt, n, k, seed=4)
    ws = Workspace(torch.device(DEVICE), int8_activations=precision == "fast",
                   float32_products=precision == "exact", max_elements=16 * k)
    lin = QuantLinear(packed, None, ws)
    assert lin._q8 is None and lin._max_m == kernels.MAX_M
    for m, tol in ((2, FP32_TOL), (12, FP32_TOL if precision == "exact" else BF16_W_TOL)):
        x = torch.randn(m, k).to(DEVICE)
        y = lin(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert _rel(y, x.double().cpu().numpy() @ ref.T) <= tol, (precision, m)


def test_layer_of_a_grid_file(tmp_path) -> None:
    """A layer of a tiny IQ3_XXS llama file built for the kernels as a load builds it: its size
    is what the VRAM planner predicts, and its fused q/k/v and gate/up projections (the
    formats' planes concatenated by rows) dequantize to gguf-py's tensors stacked."""
    from slipstream.memory.vram import layer_image_bytes
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.precision import Precision
    from slipstream.synth import write_synth
    from slipstream.weights.image import to_image
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder, TensorSource

    path = write_synth(tmp_path / "iq3.gguf", "tiny", "IQ3_XXS", seed=3, n_layers=1)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    dev = torch.device(DEVICE)
    builder = LayerBuilder(cfg, dev, Precision.of("exact", dev), workspace=Workspace(dev))
    builder.quantized = True
    layer = builder.build(TensorSource(gf), 0)
    assert to_image(layer, pin=False).nbytes == layer_image_bytes(gf, cfg, 0)

    def weight(part: str) -> np.ndarray:
        t = gf.tensors[f"blk.0.{part}.weight"]
        assert t.ggml_type == T.IQ3_XXS
        w = gguf.quants.dequantize(np.asarray(gf.tensor_bytes(t.name)), T.IQ3_XXS)
        return np.asarray(w, dtype=np.float64).reshape(t.shape)  # (rows, cols)

    for lin, parts in ((layer.attn_qkv, ("attn_q", "attn_k", "attn_v")),
                       (layer.ffn_gate_up, ("ffn_gate", "ffn_up"))):
        ref = np.concatenate([weight(p) for p in parts])
        assert lin.packed.qtype == T.IQ3_XXS and lin.packed.rows == ref.shape[0]
        w = kernels.dequantize(lin.packed, torch.float32).double().cpu().numpy()
        assert np.array_equal(w, ref), parts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loads a model on CUDA")
@pytest.mark.parametrize("arch, mix", [("llama", "IQ3_XXS"), ("llama", "IQ2_XXS"),
                                       ("llama", "IQ1_M"), ("qwen3moe", "IQ3_S"),
                                       ("mixtral", "IQ2_XS")])
def test_grid_file_on_cuda_matches_cpu(tmp_path, monkeypatch, arch: str, mix: str) -> None:
    """A tiny file with its layer matrices (experts too: the routed GEMV) in the format: the
    CUDA engine at "exact" against the CPU engine's logits (the bound of
    tests/gpu/test_families_gpu.py)."""
    import slipstream
    from helpers import rel64, streamed_logits
    from slipstream.synth import write_synth

    monkeypatch.setenv("SLIPSTREAM_CUDA_MOE", "1")  # the experts' CUDA path is opt-in
    path = write_synth(tmp_path / f"{arch}-{mix}.gguf", "tiny", mix, arch=arch, seed=3,
                       std=0.02, n_layers=2)
    cpu = slipstream.load(path, device="cpu", ctx=256, precision="exact")
    gpu = slipstream.load(path, device="cuda", ctx=256, precision="exact")
    for a, b in zip(streamed_logits(cpu), streamed_logits(gpu)):
        assert rel64(b, a) < 1e-2, (arch, mix)
    cpu.close()
    gpu.close()
