"""Whole models whose experts are in the codebook formats decoding on the CPU at the default
precision, through cb4 (weights.cpu.codebook, native/cb4_matvec.c): gpt-oss with MXFP4 experts
(as it ships; its clamped SwiGLU and biases inside the one native expert sum, native/moe_ffn.c:
test_glu_expert_sum.py) and
a Qwen3-MoE file requantized to IQ4_XS (SwiGLU, no biases: the one native expert sum,
native/moe_ffn.c).

References: precision="exact" (float32 weights as gguf-py-checked dequantizers make them, no
activation quantization), held to the tolerances test_gptoss.py and test_moe_cpu_decode.py use
for the default precision; and llama.cpp (llama-cpp-python) on the same file, whose matmuls
quantize the activations to 8 bits, held to test_codebook_model.py's and test_gptoss.py's
quantized-file tolerances.
"""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_engine, refuse_expert_loop
from llamacpp_ref import rel_err, unname
from slipstream import native
from slipstream.model.moe import expert_sum
from slipstream.quant.requantize import requantize
from slipstream.synth import write_synth
from slipstream.weights.cpu import PackedDecodeLinear
from slipstream.weights.cpu.codebook import Cb4Linear

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

IDS = list(range(7, 300, 11))  # 27 tokens: past the tiny shape's 16-position window
PREFILL = 20
# the default precision against "exact" (test_gptoss.py's; measured 1.4e-3 there on two layers)
DEFAULT_REL_TOL = 1e-2
# against llama.cpp on the quantized file (8-bit activations): test_gptoss.py's MXFP4 bound
# (weights of std 0.02) and test_codebook_model.py's for IQ4_XS experts (std 0.15)
MXFP4_LLAMACPP_TOL = 2e-2
IQ4_XS_LLAMACPP_TOL = 0.2


@pytest.fixture(scope="module")
def gptoss_mxfp4(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss-mxfp4")
    return unname(write_synth(d / "m.gguf", "tiny", "MXFP4", n_layers=2, arch="gpt-oss",
                              seed=3, std=0.02), "gpt-oss")


@pytest.fixture(scope="module")
def qwen3moe_iq4xs(tmp_path_factory):
    """A Qwen3-MoE file written in Q8_0, then every matrix re-encoded as IQ4_XS (IQ4_NL where
    its rows are not whole 256-column blocks)."""
    d = tmp_path_factory.mktemp("qwen3moe-iq4xs")
    q8 = write_synth(d / "q8.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen3moe", seed=5,
                     std=0.15)
    return requantize(q8, d / "iq4xs.gguf", "IQ4_XS", fallback="IQ4_NL")


def _stepped(engine) -> torch.Tensor:
    """A prefill of PREFILL tokens, then decode one token at a time past the window."""
    return torch.cat([engine.forward(IDS[:PREFILL], all_logits=True)]
                     + [engine.forward(IDS[i:i + 1]) for i in range(PREFILL, len(IDS))])


def _expert_kinds(engine) -> set[str]:
    bank = engine.weights.layers[0].moe.experts
    lins = list(bank.gate_up) + list(bank.down)
    assert all(isinstance(lin, PackedDecodeLinear) for lin in lins)
    return {type(lin.packed).__name__ for lin in lins}


@pytest.mark.slow
def test_gptoss_mxfp4_experts_decode_as_exact_does(gptoss_mxfp4):
    exact = cpu_engine(gptoss_mxfp4, precision="exact").forward(IDS, all_logits=True)
    engine = cpu_engine(gptoss_mxfp4)
    assert _expert_kinds(engine) == {"Cb4Linear"}
    assert engine.weights.layers[0].moe.experts.gate_up[0].packed.grid == 1  # MXFP4's
    stepped = _stepped(engine)
    assert rel_err(stepped, exact) < DEFAULT_REL_TOL
    assert torch.equal(stepped.argmax(-1), exact.argmax(-1))


@pytest.mark.slow
def test_qwen3moe_iq4xs_experts_decode_natively_as_exact_does(qwen3moe_iq4xs, monkeypatch):
    """Every decode token's experts in the one native call (the op-by-op loop made to fail),
    near "exact"; and a negative control: the experts' scales doubled miss it."""
    exact = cpu_engine(qwen3moe_iq4xs, precision="exact").forward(IDS, all_logits=True)
    engine = cpu_engine(qwen3moe_iq4xs)
    assert _expert_kinds(engine) == {"Cb4Linear"}
    engine.forward(IDS[:PREFILL], all_logits=True)  # the prefill may take the loop
    engine.reset()

    refuse_expert_loop(monkeypatch)
    stepped = _stepped(engine)
    assert rel_err(stepped, exact) < DEFAULT_REL_TOL
    assert torch.equal(stepped.argmax(-1), exact.argmax(-1))
    bank = engine.weights.layers[0].moe.experts
    for lin in list(bank.gate_up):  # negative control: layer 0's gate/up scales doubled
        p = lin.packed.packed
        s = p[..., 256:].contiguous().view(torch.float32) * 2
        p[..., 256:] = s.view(torch.uint8).view(p[..., 256:].shape)
    engine.reset()
    assert rel_err(_stepped(engine), exact) > 10 * DEFAULT_REL_TOL


@pytest.mark.slow
def test_decode_matches_llamacpp_on_the_file(gptoss_mxfp4, qwen3moe_iq4xs):
    """The default precision's decode (cb4) against llama.cpp's run of the same files."""
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import llamacpp_logits

    for path, tol in ((gptoss_mxfp4, MXFP4_LLAMACPP_TOL), (qwen3moe_iq4xs, IQ4_XS_LLAMACPP_TOL)):
        engine = cpu_engine(path)
        assert _expert_kinds(engine) == {"Cb4Linear"}
        err = rel_err(_stepped(engine), llamacpp_logits(path, IDS))
        assert err < tol, f"{path.name}: relative error {err:.2e} against llama.cpp"


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["IQ4_NL", "IQ4_XS"])
def test_dense_layers_decode_through_cb4_as_exact_does(quant, tmp_path):
    """A llama file whose matrices are IQ4_NL or IQ4_XS (IQ4_NL where rows are not whole
    256-column blocks): every layer's linears decode through cb4, near "exact"."""
    path = write_synth(tmp_path / "m.gguf", "tiny", quant, n_layers=2, seed=2, std=0.15)
    exact = cpu_engine(path, precision="exact").forward(IDS, all_logits=True)
    engine = cpu_engine(path)
    layer = engine.weights.layers[0]
    packed = [v.packed for v in vars(layer).values() if isinstance(v, PackedDecodeLinear)]
    assert packed and all(isinstance(p, Cb4Linear) for p in packed)
    stepped = _stepped(engine)
    assert rel_err(stepped, exact) < DEFAULT_REL_TOL
    assert torch.equal(stepped.argmax(-1), exact.argmax(-1))
