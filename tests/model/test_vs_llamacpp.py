"""The forward pass against llama.cpp (llama-cpp-python on the CPU) loading the same GGUF: a
second reference beside transformers (test_vs_transformers.py, test_families.py), and the
implementation GGUF files are written for.

Every architecture of model.families.ARCHITECTURES is checked on a synthetic Q8_0 file of its
family's layer, so a family added there is compared here without editing this module; one
that llama.cpp cannot load is an expected failure with the reason, not a skip. slipstream runs
at precision="exact" (float32 weights dequantized from the file).

Each file is compared twice. llama.cpp's CPU matmuls on quantized weights quantize the
activations to 8 bits too (vec_dot_q8_0_q8_0 for Q8_0, q4_1 x q8_1 for Q4_1), which moves
the logits by percents on these files, so on the file itself only a loose tolerance holds.
The tight comparison is on a float32 copy of the same file (quant.requantize: the weights
slipstream computes with, written out), where llama.cpp's float32 matmuls leave nothing but
summation order and its own small roundings."""

from __future__ import annotations

from pathlib import Path

import dataclasses

import pytest
import torch

from helpers import cpu_engine, cpu_stages
from llamacpp_ref import decisive, llamacpp_logits, llamacpp_tokens, rel_err, unname
from slipstream.model.families import ARCHITECTURES
from slipstream.quant.requantize import requantize
from slipstream.runtime.engine import Engine
from slipstream.synth import SHAPES, synth_window, write_synth

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it is in the "
                    "`test` extra: pip install -e '.[test]')")

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary: past the tiny shape's
# 16-position sliding window
N_LAYERS = 6  # Gemma 3's five sliding-window layers and one global one

# Architectures llama.cpp has no loader for, with why. They run anyway, strictly: the test
# fails the day llama.cpp loads one, so this table cannot go stale.
CANNOT_LOAD = {
    "mistral": "llama.cpp has no 'mistral' architecture (Mistral 7B GGUFs say 'llama'; it "
               "knows mistral3 and mistral4)",
}

# Architectures whose sliding window llama.cpp ignores, with why: compared on the first
# window's worth of tokens only, where a window changes nothing
NO_WINDOW = {
    "phi3": "llama.cpp turns Phi-3's sliding window off (it warns 'Phi SWA is currently "
            "disabled') and attends to every position",
}

# Float32 copies, relative error (norm of the difference / norm of llama.cpp's logits),
# measured with llama-cpp-python 0.3.36: llama 4.6e-6, qwen2 3.7e-6, qwen3 1.8e-6, gemma3
# 2.1e-4 (ggml's CPU GELU looks its input up in a float16 table), SmolLM2 2e-6 and 3e-6;
# mistral3 8.4e-6, glm4 5.4e-6, olmo2 1.0e-6, cohere2 1.6e-6, phi3 3.1e-6 (16 tokens),
# qwen3moe 2.6e-6, glm4moe 1.3e-6, deepseek2 7.4e-6, qwen35 2.5e-6, qwen35moe 5.4e-6.
F32_REL_TOL = 1e-3
# gemma4 measured 1.2e-3: two GELUs a layer (its FFN's and its per-layer embedding branch's)
# through ggml's float16 table; rounding our GELU's input and output to float16 as the table
# does halved it (1.7e-3 to 8.5e-4, on a file with 32-wide per-layer embeddings)
F32_REL_TOL_OF = {"gemma4": 4e-3}
# A top-1 token can flip only where the top-2 gap is below the sum of two logits' differences:
# measured at most 9e-4 logit standard deviations per logit (gemma3; 1.1e-4 for the others),
# so a gap over 5e-3 standard deviations is decided
F32_DECISIVE_GAP = 5e-3

# The quantized files as llama.cpp runs them: measured 1.3e-2 (gemma3) to 9.0e-2 (llama) and
# 1.0e-1 (glm4, mistral3; phi3 9.7e-2; qwen3moe 1.2e-1, whose routing turns small
# differences into other experts). Random weights this large make the 6 layers chaotic:
# llama.cpp's 8-bit activations move single logits by up to 0.96 standard deviations and flip
# top-1 at up to 30% of the 27 positions, so top-1 is held on the float32 copies only. A wrong
# block or format is far outside: a window mismatch measured 0.58
Q8_REL_TOL = 0.2
# gpt-oss measured 0.31, as far as llama.cpp's own run of the file is from its run of the
# float32 copy (0.31, top-1 at 70% of positions): top-k routing over these random weights
# sends many tokens elsewhere for 8-bit differences (its float32 copy agrees to 2.5e-5, and
# its MXFP4 file at the synth default std agrees to 7e-3: tests/model/test_gptoss.py)
# glm4moe measured 0.22 for the same reason: llama.cpp's run of its file is 0.22 from its run
# of the float32 copy (top-1 at 85% of positions), which slipstream's run of the file
# matches to 1.8e-6; deepseek2 0.49, as far as llama.cpp's run of its file is from its run of
# the float32 copy (0.49, top-1 at 44% of positions; slipstream's run of the file: 1.2e-5
# from llama.cpp's float32 copy), its 8-bit latents and routing both amplified over 6 layers;
# qwen35moe 0.20, as far as llama.cpp's run of its file is from its run of the float32 copy
# (0.20, top-1 at 81% of positions; slipstream's run of the file: 5.4e-6 from that copy's)
Q8_REL_TOL_OF = {"gpt-oss": 0.4, "glm4moe": 0.3, "deepseek2": 0.6, "qwen35moe": 0.3}
# SmolLM2's Q4_1 weights (activations quantized to Q8_1): measured 2.9e-2 and 4.2e-2, top-1
# agreement 100% and 94% (two flips, at top-2 gaps of 5e-3 and 1.5e-2 standard deviations)
Q4_1_REL_TOL = 8e-2
Q4_1_MIN_TOP1 = 0.85


def _ids(arch: str) -> list[int]:
    return IDS[:synth_window(SHAPES["tiny"])] if arch in NO_WINDOW else IDS


def _architectures(fast: str | None = None) -> list:
    """Every architecture as a parameter: `fast` in the fast tier, the rest slow (0.4 to 8 s
    each, measured on 2 cores shared with other work), those llama.cpp cannot load as strict
    expected failures."""
    params = []
    for arch in sorted(ARCHITECTURES):
        if arch in CANNOT_LOAD:
            params.append(pytest.param(arch, marks=pytest.mark.xfail(
                reason=CANNOT_LOAD[arch], raises=ValueError, strict=True)))
        else:
            params.append(pytest.param(arch, marks=() if arch == fast else pytest.mark.slow))
    return params


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """arch -> (its Q8_0 synthetic file, a float32 copy of it), written on first use."""
    made: dict[str, tuple[Path, Path]] = {}

    def files(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            d = tmp_path_factory.mktemp(arch)
            q8 = write_synth(d / f"{arch}.gguf", "tiny", "Q8_0", arch=arch, from_floats=True,
                             std=0.15, seed=3, n_layers=N_LAYERS)
            unname(q8, arch)
            made[arch] = (q8, requantize(q8, d / f"{arch}-f32.gguf", "F32"))
        return made[arch]

    return files



# llama's file is the cheapest (0.2 to 0.5 s on 2 shared cores): the fast tier's check
@pytest.mark.parametrize("arch", _architectures(fast="llama"))
def test_family_matches_llamacpp(family_files, arch):
    q8, f32 = family_files(arch)
    ref = llamacpp_logits(f32, _ids(arch))
    ours = cpu_engine(q8, precision="exact").forward(_ids(arch), all_logits=True)
    _assert_close(ours, ref, F32_REL_TOL_OF.get(arch, F32_REL_TOL))
    keep = decisive(ref, F32_DECISIVE_GAP)
    assert keep.float().mean() > 0.5, "too few decided positions for top-1 to mean anything"
    differ = (ours.argmax(-1) != ref.argmax(-1)) & keep
    assert not differ.any(), f"top-1 differs at decided positions {differ.nonzero().flatten()}"


def test_llamacpp_tells_a_wrong_block_apart(family_files):
    """Negative control: the other RoPE pairing, a one-attribute slip, must be far outside the
    tolerance, or agreeing with llama.cpp would prove little."""
    q8, f32 = family_files("llama")
    ref = llamacpp_logits(f32, IDS)
    engine = cpu_engine(q8, precision="exact")
    object.__setattr__(engine.cfg, "rope_style", "neox")
    engine.rope.style = "neox"
    assert rel_err(engine.forward(IDS, all_logits=True), ref) > 100 * F32_REL_TOL


@pytest.mark.slow
@pytest.mark.parametrize("piece", ["per_layer_dim", "rope_factors", "kv_source"])
def test_llamacpp_tells_a_wrong_gemma4_apart(family_files, piece):
    """Negative control of Gemma 4's own pieces against llama.cpp: without the per-layer
    embeddings, with every global frequency turning (no "proportional" divisors), or with
    the reusing layers reading the wrong earlier layer's keys and values."""
    q8, f32 = family_files("gemma4")
    ref = llamacpp_logits(f32, IDS)
    engine = cpu_engine(q8, precision="exact")
    cfg, weights = engine.cfg, engine.weights
    if piece == "per_layer_dim":
        cfg = dataclasses.replace(cfg, per_layer_dim=0)
    elif piece == "rope_factors":
        weights = dataclasses.replace(weights, rope_freqs=None)
    else:  # the sliding reusers read layer 0 instead of the last sliding layer before them
        cfg = dataclasses.replace(cfg)
        source = cfg.kv_source
        object.__setattr__(cfg, "kv_source",
                           lambda i: 0 if i != source(i) and cfg.sliding(i) else source(i))
    wrong = Engine(cfg, weights, cpu_stages(cfg, weights, 64))
    assert rel_err(wrong.forward(IDS, all_logits=True), ref) > 30 * F32_REL_TOL_OF["gemma4"]


@pytest.mark.parametrize("arch", _architectures())
def test_family_quantized_matches_llamacpp(family_files, arch):
    q8, _ = family_files(arch)
    ref = llamacpp_logits(q8, _ids(arch))
    ours = cpu_engine(q8, precision="exact").forward(_ids(arch), all_logits=True)
    _assert_close(ours, ref, Q8_REL_TOL_OF.get(arch, Q8_REL_TOL))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert ours.shape == ref.shape
    err = rel_err(ours, ref)
    assert err < tol, f"relative error {err:.2e} against llama.cpp (tolerance {tol:.0e})"


def _assert_top1_rate(ours: torch.Tensor, ref: torch.Tensor, least: float) -> None:
    rate = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rate >= least, f"top-1 agrees with llama.cpp at {rate:.0%} of positions"


# A chat turn as the server sends it, and plain text: SmolLM2's own control tokens and
# multi-byte characters go through both tokenizers
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France, and why is it famous?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Les élèves ont étudié 日本語 and emoji 🎉 together; the quick brown fox jumps over",
]


@pytest.fixture(scope="module")
def real_model(smollm_path, tmp_path_factory):
    """SmolLM2's tokenizer, an "exact" engine on it, and a float32 copy of the file (540 MB)."""
    import gguf

    from slipstream.modelfile.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_reader(gguf.GGUFReader(str(smollm_path)))
    f32 = requantize(smollm_path, tmp_path_factory.mktemp("smollm") / "smollm-f32.gguf", "F32")
    return tok, cpu_engine(smollm_path, ctx=512, precision="exact"), f32


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_model_matches_llamacpp(smollm_path, real_model, prompt):
    tok, engine, f32 = real_model
    ids = tok.encode(prompt)
    assert ids == llamacpp_tokens(smollm_path, prompt), "the two tokenizers disagree"
    engine.reset()
    ours = engine.forward(ids, all_logits=True)
    exact = llamacpp_logits(f32, ids)
    _assert_close(ours, exact, F32_REL_TOL)
    assert torch.equal(ours.argmax(-1)[decisive(exact, F32_DECISIVE_GAP)],
                       exact.argmax(-1)[decisive(exact, F32_DECISIVE_GAP)])
    quantized = llamacpp_logits(smollm_path, ids)
    _assert_close(ours, quantized, Q4_1_REL_TOL)
    _assert_top1_rate(ours, quantized, Q4_1_MIN_TOP1)
