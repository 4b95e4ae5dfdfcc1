"""The forward pass against Hugging Face transformers loading the same GGUF (float32)."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_engine
from slipstream.synth import write_synth

transformers = pytest.importorskip("transformers")

# fp16 weights and a float32 residual stream: measured ~1e-3 relative error on the real model
REL_TOL = 5e-3

PROMPTS = [
    "The capital of France is a city with a long history of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Les élèves ont étudié 日本語 and emoji 🎉 together.",
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def hf_smollm(smollm_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent),
                                                     gguf_file=smollm_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def ours_smollm(smollm_path):
    return cpu_engine(smollm_path, ctx=512)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_model_logits_match_transformers(hf_smollm, ours_smollm, prompt):
    tok, model = hf_smollm
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours_smollm.reset()
    ours = ours_smollm.forward(ids, all_logits=True)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert rel_err(ours, ref) < REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def exact_smollm(smollm_path):
    return cpu_engine(smollm_path, ctx=512, precision="exact")


@pytest.mark.slow
def test_kv_cache_decode_matches_full_recompute(exact_smollm):
    """The cache, not the kernels: at "exact" decode and prefill use the same float32 weights
    (at "fast" decode goes through packed copies, tested below)."""
    ids = [504, 3575, 282, 4649, 314, 253, 2240, 351, 253, 986, 1463, 282, 3573, 30, 216]
    exact_smollm.reset()
    full = exact_smollm.forward(ids, all_logits=True)
    exact_smollm.reset()
    parts = [exact_smollm.forward(ids[:4], all_logits=True)]
    parts += [exact_smollm.forward(ids[i:i + 1]) for i in range(4, 9)]
    parts.append(exact_smollm.forward(ids[9:], all_logits=True))  # a second batched chunk
    stepped = torch.cat(parts)
    assert rel_err(stepped, full) < 1e-4
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


# precision="fast" decodes through packed int4 copies with bfloat16 activations
# (weights.cpu): measured 1.9e-2 relative to the float32 prefill on these tokens, and
# +0.004% perplexity with 97.5% top-1 agreement against the float32 weights (SmolLM2-135M Q4_1,
# 1152 positions of the calibration text)
PACKED_REL_TOL = 4e-2


@pytest.mark.slow
def test_packed_decode_matches_transformers(hf_smollm, ours_smollm):
    from slipstream.weights.cpu import PackedDecodeLinear

    layer = ours_smollm.weights.layers[0]
    assert isinstance(layer.attn_qkv, PackedDecodeLinear)
    assert isinstance(ours_smollm.weights.output, PackedDecodeLinear)
    tok, model = hf_smollm
    ids = tok(PROMPTS[0] + " Paris, which is also known for its museums and")["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours_smollm.reset()
    ours_smollm.forward(ids[:4])
    stepped = torch.cat([ours_smollm.forward(ids[i:i + 1]) for i in range(4, len(ids))])
    assert rel_err(stepped, ref[4:]) < PACKED_REL_TOL
    agree = (stepped.argmax(-1) == ref[4:].argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def _synth_pair(tmp_path, arch: str, quant: str, tie: bool, rope_freqs: bool = False):
    # std 0.15 makes attention scores far from uniform, so a wrong RoPE pairing shows up
    path = write_synth(tmp_path / f"{arch}-{quant}.gguf", "tiny", quant, arch=arch,
                       from_floats=True, seed=3, tie_embeddings=tie, std=0.15,
                       rope_freqs=rope_freqs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32)
    return path, hf.eval()


@pytest.mark.parametrize("arch,quant,tie", [("llama", "Q8_0", False), ("llama", "Q4_K", True),
                                            ("qwen2", "Q8_0", True), ("qwen2", "Q6_K", False)])
def test_synthetic_architectures_match_transformers(tmp_path, arch, quant, tie):
    path, hf = _synth_pair(tmp_path, arch, quant, tie)
    ids = list(range(7, 300, 11))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    engine = cpu_engine(path)
    ours = engine.forward(ids, all_logits=True)
    assert rel_err(ours, ref) < REL_TOL
    # Negative control: the other RoPE pairing must be clearly wrong, or this test could not
    # tell them apart.
    object.__setattr__(engine.cfg, "rope_style", "neox" if arch == "llama" else "normal")
    engine.rope.style = engine.cfg.rope_style
    engine.reset()
    wrong = engine.forward(ids, all_logits=True)
    assert rel_err(wrong, ref) > 10 * REL_TOL


@pytest.mark.slow
def test_perplexity_matches_transformers(hf_smollm, ours_smollm):
    from slipstream.runtime.perplexity import perplexity

    tok, model = hf_smollm
    text = ("Perplexity measures how well a language model predicts a text. A lower value "
            "means the model is less surprised by each next token, and a model that matches "
            "another's logits closely must also match its perplexity. ") * 6
    ids = tok(text)["input_ids"]
    ctx = 64

    def ours(chunk):
        ours_smollm.reset()
        return ours_smollm.forward(chunk, all_logits=True)

    def theirs(chunk):
        with torch.no_grad():
            return model(torch.tensor([chunk])).logits[0]

    a = perplexity(ours, ids, ctx)
    b = perplexity(theirs, ids, ctx)
    # and once more with code that shares nothing with runtime.perplexity
    nll = []
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        logits = theirs(chunk)[ctx // 2:ctx - 1]
        nll.append(torch.nn.functional.cross_entropy(
            logits, torch.tensor(chunk[ctx // 2 + 1:]), reduction="sum"))
    manual = float(torch.exp(torch.stack(nll).sum() / (a.scored_tokens)))
    assert a.chunks == len(ids) // ctx >= 2
    assert abs(b.ppl - manual) / manual < 1e-4
    assert abs(a.ppl - b.ppl) / b.ppl < 0.005
