"""Gemma 3 270M, a real model (Q4_K_M: q/k and the FFN's gate/up in Q5_0, v in Q8_0, o in
Q4_K, down in Q6_K, the tied 262144-token table in Q8_0), against llama.cpp (llama-cpp-python
on the CPU) on the same file: its tokenizer, its logits on a float32 copy of the file (the
weights slipstream computes with at "exact", written out, so that llama.cpp's 8-bit
activations are out of the way), its quantized file as llama.cpp runs it, the default
precision against "exact", and streamed layers against resident ones."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_budget
from llamacpp_ref import decisive, llamacpp_logits, llamacpp_tokens, rel_err
import slipstream
from slipstream.quant.requantize import requantize

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it is in the "
                    "`test` extra: pip install -e '.[test]')")
pytestmark = pytest.mark.slow  # a 253 MB model, its 1.08 GB float32 copy, llama.cpp

TEXT = ("Paris is the capital of France, and Berlin is the capital of Germany. The quick "
        "brown fox jumps over the lazy dog.\ndef fibonacci(n):\n    if n < 2:\n        "
        "return n\n")
TOKENIZER_TEXTS = [
    TEXT, "  Leading spaces, émigré naïve café — 東京 🙂\t tabs",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "x" * 40 + " 1234567890 3.14159 ??!! <unused0> </s>",
]
# On the float32 copy over the 631 ids: measured 3.1e-4 (llama-cpp-python 0.3.36), the rest
# ggml's CPU GELU, which looks its input up in a float16 table (a synthetic Gemma 3: 2.1e-4)
F32_REL_TOL = 1e-3
CTX = 1024
STEPS = 48  # positions the one-token-a-step tests run (a step reads the whole model)
# A top-1 token is decided where the best two logits differ by more than this many standard
# deviations of the position's logits: a logit differed by at most 1.2e-2 of one, so two by
# 2.4e-2 (628 of the 631 positions are decided so)
DECISIVE_GAP = 3e-2


@pytest.fixture(scope="module")
def ids(gemma3_path) -> list[int]:
    """The text over and over, past the 512 positions of Gemma 3's sliding window."""
    ids = llamacpp_tokens(gemma3_path, " ".join([TEXT] * 14))
    assert len(ids) > 512 + 32
    return ids


@pytest.fixture(scope="module")
def f32_copy(gemma3_path, tmp_path_factory):
    return requantize(gemma3_path, tmp_path_factory.mktemp("f32") / "gemma3-270m-f32.gguf",
                      "F32")


@pytest.fixture(scope="module")
def exact_logits(gemma3_path, ids) -> torch.Tensor:
    with slipstream.load(gemma3_path, device="cpu", precision="exact", ctx=CTX) as m:
        return m.logits(ids).float()


def test_tokenizer_matches_llamacpp(gemma3_path):
    with slipstream.load(gemma3_path, device="cpu", ctx=64) as m:
        for text in TOKENIZER_TEXTS:
            assert m.tokenizer.encode(text) == llamacpp_tokens(gemma3_path, text), text


def test_exact_matches_llamacpp_on_the_float32_copy(f32_copy, ids, exact_logits):
    copy = f32_copy
    with slipstream.load(copy, device="cpu", precision="exact", ctx=CTX) as m:
        # the copy holds the weights "exact" dequantizes the file to: the same bits
        assert torch.equal(m.logits(ids).float(), exact_logits)
    ref = llamacpp_logits(copy, ids)
    assert rel_err(exact_logits, ref) < F32_REL_TOL
    sure = decisive(ref, DECISIVE_GAP)
    assert sure.sum() >= len(ids) // 2  # a real model decides most positions
    assert torch.equal(exact_logits.argmax(-1)[sure], ref.argmax(-1)[sure])


def test_quantized_file_is_as_close_to_llamacpp_as_llamacpp_is_to_itself(
        gemma3_path, f32_copy, ids, exact_logits):
    """llama.cpp's run of the Q4_K_M file quantizes its activations to 8 bits; slipstream's
    "exact" run of it stands no farther from it than llama.cpp's own run of the float32 copy
    (measured 3.87e-2 both over the 631 ids)."""
    ref_q = llamacpp_logits(gemma3_path, ids)
    ref_f32 = llamacpp_logits(f32_copy, ids)
    own = rel_err(ref_f32, ref_q)
    assert 1e-3 < own < 0.2  # the 8-bit activations move it, and not by a wrong model
    assert rel_err(exact_logits, ref_q) < 1.2 * own


def test_default_precision_keeps_exacts_top1_step_by_step(gemma3_path, ids, exact_logits):
    """The default precision's packed decode (mixed q/k/v formats included), one token a step
    as generation runs it: measured 6.5e-3 from "exact"."""
    with slipstream.load(gemma3_path, device="cpu", ctx=128) as m:
        fast = m.logits(ids[:STEPS], one_at_a_time=True).float()
    exact = exact_logits[:STEPS]
    assert rel_err(fast, exact) < 2e-2
    sure = decisive(exact, DECISIVE_GAP)
    assert torch.equal(fast.argmax(-1)[sure], exact.argmax(-1)[sure])


def test_streamed_layers_give_the_resident_bits(gemma3_path, ids):
    with slipstream.load(gemma3_path, device="cpu", ctx=128) as m:
        resident = m.logits(ids[:16], one_at_a_time=True)
    budget = cpu_budget(gemma3_path, packed=6, ctx=128)
    with slipstream.load(gemma3_path, device="cpu", ctx=128,
                         placement=slipstream.Placement(ram_budget=budget)) as m:
        assert m.plan.disk_layers  # 12 of its 18 layers read from disk every step
        assert torch.equal(m.logits(ids[:16], one_at_a_time=True), resident)
