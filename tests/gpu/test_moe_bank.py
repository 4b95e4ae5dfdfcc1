"""A mixture of experts' GPU bank (weights.routed_experts) built by the loader from synth files
of each family (Qwen3-MoE, Mixtral, gpt-oss: MXFP4 experts with biases and the clamped
SwiGLU), against the CPU engine's bank of the same layer (dense float32 weights at precision
"exact", which tests/model/test_moe.py and test_gptoss.py check against llama.cpp and
transformers): the routed decode path (up to 8 rows, ids read on the device) and the grouped
prefill path.

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs the same checks in Triton's interpreter
(the loader's GPU build forced onto the CPU device).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from slipstream.model.moe import moe_ffn, route  # noqa: E402
from slipstream.modelfile.config import ModelConfig  # noqa: E402
from slipstream.modelfile.gguf_file import GGUFFile  # noqa: E402
from slipstream.precision import Precision  # noqa: E402
from slipstream.synth import SynthShape, write_synth  # noqa: E402
from slipstream.weights.linear import Workspace  # noqa: E402
from slipstream.weights.loader import LayerBuilder, TensorSource  # noqa: E402
from slipstream.weights.routed_experts import RoutedExperts  # noqa: E402

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

DEVICE = torch.device(os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda"))
CPU = torch.device("cpu")
# float32 products and sums on both sides (orders differ); "fast" rounds the activations to
# int8 per block of 32 before each projection (tests/gpu/test_kernels.py's 1.5e-2 per GEMV)
TOL = {"exact": 1e-5, "fast": 4e-2}
INTERPRET = DEVICE.type == "cpu"
# the interpreter runs each program in Python: a smaller model there (64 wide, 4 experts of
# 64), whose rows take block-32 formats and floats only (the K-quants' 256 are covered by
# tests/gpu/test_moe_kernels.py)
CASES = ([("qwen3moe", "Q8_0"), ("mixtral", "F16"), ("gpt-oss", "MXFP4")] if INTERPRET
         else [("qwen3moe", "Q4_K"), ("mixtral", "Q8_0"), ("gpt-oss", "MXFP4")])
MICRO = SynthShape(hidden=64, ffn=128, n_layers=1, n_heads=2, n_kv_heads=1, vocab=256,
                   context=256, rope_base=10000.0, n_experts=4, n_experts_used=2,
                   expert_ffn=64)
# rows of a pass: decode-sized ones take the routed GEMVs, more than 8 the grouped linears
ROWS = (1, 3, 9) if INTERPRET else (1, 3, 10, 40)


def _gpu_builder(cfg: ModelConfig, precision: str) -> LayerBuilder:
    """The loader's builder for the GPU; on the interpreter's CPU device, with the GPU's
    precision flags and its quantized (packed) build forced."""
    if DEVICE.type == "cuda":
        return LayerBuilder(cfg, DEVICE, Precision.of(precision, DEVICE))
    p = Precision.of(precision, CPU)
    fast = precision == "fast"
    p = dataclasses.replace(p, int8_activations=fast, fuse_scales=fast,
                            cpu_packed_decode=False, float32_products=not fast)
    ws = Workspace(DEVICE, int8_activations=fast, float32_products=not fast)
    builder = LayerBuilder(cfg, DEVICE, p, workspace=ws)
    builder.quantized = True
    builder.fuse_scales = fast
    return builder


def _banks(tmp_path, arch: str, quant: str, precision: str, fused: bool = False):
    path = write_synth(tmp_path / f"{arch}-{fused}.gguf", MICRO if INTERPRET else "tiny", quant,
                       n_layers=1, arch=arch, fused_experts=fused)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    src = TensorSource(gf)
    from slipstream.weights.experts import build_experts

    cpu = build_experts(LayerBuilder(cfg, CPU, Precision.of("exact", CPU)), src, "blk.0")
    gpu = build_experts(_gpu_builder(cfg, precision), src, "blk.0")
    return cfg, cpu, gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def test_a_fused_files_routed_bank_is_its_split_twins(tmp_path) -> None:
    """Gate and up stored as one ffn_gate_up_exps tensor stack into the same [gate_e | up_e]
    planes as the split file's two tensors: the same outputs, bit for bit."""
    quant = CASES[0][1]
    _, _, split = _banks(tmp_path, "qwen3moe", quant, "exact")
    cfg, _, fused = _banks(tmp_path, "qwen3moe", quant, "exact", fused=True)
    g = torch.Generator().manual_seed(2)
    for rows in ROWS:
        h = torch.randn(rows, cfg.hidden, generator=g).to(DEVICE)
        weights, ids = route(h, split.router, split.top_k)
        assert torch.equal(split.experts.mix(h, ids, weights), fused.experts.mix(h, ids, weights))


@pytest.mark.parametrize("arch,quant", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_routed_bank_matches_cpu_bank(tmp_path, arch: str, quant: str, precision: str) -> None:
    """Decode-sized passes (1 and 3 rows) through the routed GEMVs, prefill-sized ones (more
    than 8 rows) through the grouped per-expert linears: each within the precision's bound of
    the CPU bank on the same routing."""
    cfg, cpu, gpu = _banks(tmp_path, arch, quant, precision)
    assert isinstance(gpu.experts, RoutedExperts)
    assert (gpu.router_bias is not None) == (arch == "gpt-oss")
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:
        h = torch.randn(rows, cfg.hidden, generator=g)
        weights, ids = route(h, cpu.router, cpu.top_k, cpu.normalize, cpu.router_bias,
                             cpu.gating)
        # the router on the GPU picks the same experts (float32 both sides)
        gw, gids = route(h.to(DEVICE), gpu.router, gpu.top_k, gpu.normalize, gpu.router_bias,
                         gpu.gating)
        assert torch.equal(gids.cpu(), ids)
        ref = cpu.experts.mix(h, ids, weights)
        out = gpu.experts.mix(h.to(DEVICE), gids, gw)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert _rel(out, ref) <= TOL[precision], (arch, precision, rows)
        if rows == 1:  # the layer's whole FFN as the block calls it: routing, then the bank
            whole = moe_ffn(h.to(DEVICE), gpu)
            assert _rel(whole, moe_ffn(h, cpu)) <= TOL[precision], (arch, precision)


def test_routed_bank_ids_are_read_on_the_device(tmp_path) -> None:
    """The routed path follows whatever ids it is given, repeats included: the same expert in
    every slot gives that expert's output times the sum of the weights; a wrong id changes
    the output (no cached routing)."""
    cfg, cpu, gpu = _banks(tmp_path, "mixtral", CASES[1][1], "exact")
    h = torch.randn(1, cfg.hidden)
    ids = torch.tensor([[3, 3]])
    w = torch.tensor([[0.25, 0.5]])
    out = gpu.experts.mix(h.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
    ref = cpu.experts.ffn(3, h).float() * 0.75
    assert _rel(out, ref) <= TOL["exact"]
    other = gpu.experts.mix(h.to(DEVICE), torch.tensor([[3, 0]], device=DEVICE),
                            w.to(DEVICE))
    assert _rel(other, ref) > 1e-2


def test_gate_and_up_of_different_formats() -> None:
    """Gate and up in two formats take two stacks (two routed launches, and a two-part linear
    per expert in prefill); checked against gguf-py's dequantize of each expert's bytes, the
    expert FFN and the weighted sum computed in float64."""
    import numpy as np
    from gguf import GGMLQuantizationType as T, quants

    from slipstream import kernels
    from slipstream.weights.routed_experts import RoutedLinear

    n, ffn, hidden, k = 4, 32, 64, 2
    rng = np.random.default_rng(0)
    ws = Workspace(DEVICE, int8_activations=False, float32_products=True)
    raws = {"gate": quants.quantize(rng.standard_normal((n * ffn, hidden)).astype(np.float32),
                                    T.Q8_0),
            "up": quants.quantize(rng.standard_normal((n * ffn, hidden)).astype(np.float32),
                                  T.Q4_0),
            "down": rng.standard_normal((n * hidden, ffn)).astype(np.float16)}
    types = {"gate": T.Q8_0, "up": T.Q4_0, "down": T.F16}
    shapes = {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
    dense = {p: quants.dequantize(r, types[p]).reshape(n, *shapes[p]).astype(np.float64)
             for p, r in raws.items()}

    def stack(p: str) -> RoutedLinear:
        raw = torch.from_numpy(np.ascontiguousarray(raws[p]).view(np.uint8)).reshape(
            n * shapes[p][0], -1).to(DEVICE)
        return RoutedLinear(kernels.pack_weight(raw, types[p], n * shapes[p][0],
                                                shapes[p][1]), n, None, ws)

    bank = RoutedExperts([stack("gate"), stack("up")], stack("down"))
    g = torch.Generator().manual_seed(3)
    for rows in (1, 9):
        h = torch.randn(rows, hidden, generator=g)
        ids = torch.randint(0, n, (rows, k), generator=g)
        w = torch.softmax(torch.randn(rows, k, generator=g), dim=-1)
        hs = h.double().numpy()
        ref = np.zeros((rows, hidden))
        for t in range(rows):
            for j in range(k):
                e = int(ids[t, j])
                a, b = dense["gate"][e] @ hs[t], dense["up"][e] @ hs[t]
                ref[t] += float(w[t, j]) * (dense["down"][e] @ (a / (1 + np.exp(-a)) * b))
        out = bank.mix(h.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
        assert _rel(out, torch.from_numpy(ref)) <= TOL["exact"], rows
