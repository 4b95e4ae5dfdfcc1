"""Each model family against Hugging Face transformers loading the same synthetic GGUF
(dequantized, float32), and through every memory tier slipstream has on CPU: resident, streamed
from disk (whole layers at "exact", packed images at "fast"), and as a speculative target.

The files are written by `slipstream synth --arch FAMILY`'s code with random weights of the
family's layer (model.families), std 0.15 so that attention is far from uniform and a missing
or misplaced piece of the block shows in the logits (each family has a negative control)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import slipstream
from helpers import cpu_budget, cpu_engine
from slipstream.model.families import ARCHITECTURES, FAMILIES, BlockTraits, family_for
from slipstream.synth import write_synth

transformers = pytest.importorskip("transformers")

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary: past the tiny shape's
# 16-position sliding window
# float32 weights on both sides (precision="exact"): measured below 2e-6 on these files
EXACT_REL_TOL = 1e-5
# The families beyond Llama's, with what transformers needs told beside the GGUF: its GGUF
# reader takes Qwen3's head size from the model class's default (128), not from
# qwen3.attention.key_length, and Gemma 3's query scale from query_pre_attn_scalar (default
# 256), which GGUF files do not hold
NEW_FAMILIES = {"qwen3": {"head_dim": 64}, "gemma3": {"head_dim": 64, "query_pre_attn_scalar": 64}}
# six layers: Gemma 3's five sliding-window layers and one global one
N_LAYERS = 6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=sorted(NEW_FAMILIES))
def family_file(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    path = write_synth(d / f"{arch}.gguf", "tiny", "Q8_0", n_layers=N_LAYERS, arch=arch,
                       from_floats=True, seed=3, std=0.15)
    return arch, path


@pytest.fixture(scope="module")
def reference_logits(family_file):
    arch, path = family_file
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **NEW_FAMILIES[arch])
    with torch.no_grad():
        return hf.eval()(torch.tensor([IDS])).logits[0]


def test_every_family_is_listed_once():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for arch in ARCHITECTURES:
        assert arch in family_for(arch).architectures
    assert set(NEW_FAMILIES) <= set(ARCHITECTURES)


@pytest.mark.slow
def test_logits_match_transformers(family_file, reference_logits):
    arch, path = family_file
    engine = cpu_engine(path, precision="exact")
    ours = engine.forward(IDS, all_logits=True)
    assert rel_err(ours, reference_logits) < EXACT_REL_TOL
    assert torch.equal(ours.argmax(-1), reference_logits.argmax(-1))
    # one token at a time through the KV cache: the CPU decode path of the family's block
    engine.reset()
    stepped = torch.cat([engine.forward(IDS[:5], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(5, len(IDS))])
    assert rel_err(stepped, reference_logits) < EXACT_REL_TOL
    # Negative control: the same engine without the family's trait must be clearly wrong, or
    # the comparison above could not tell the family's block from Llama's
    # (each trait in turn back to the Llama block's)
    llama = BlockTraits()
    traits = family_for(arch).traits
    changed = [f.name for f in dataclasses.fields(traits)
               if getattr(traits, f.name) != getattr(llama, f.name)]
    assert changed, f"{arch}: a family beyond Llama's has at least one trait"
    cfg = engine.cfg
    for name in changed + (["sliding_window"] if cfg.sliding_window else []):
        engine.cfg = dataclasses.replace(cfg, **{name: getattr(llama, name, 0)})
        engine.reset()
        wrong = engine.forward(IDS, all_logits=True)
        assert rel_err(wrong, reference_logits) > 100 * EXACT_REL_TOL, name
    engine.cfg = cfg


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_streamed_from_disk_gives_the_resident_bits(family_file, tmp_path, precision):
    arch, path = family_file
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    resident = slipstream.load(copy, device="cpu", ctx=64, precision=precision)
    n = resident.engine.cfg.n_layers
    budget = (cpu_budget(copy, whole=1, precision="exact") if precision == "exact"
              else cpu_budget(copy, packed=1))
    streamed = slipstream.load(copy, device="cpu", ctx=64, precision=precision,
                               placement=slipstream.Placement(ram_budget=budget))
    assert streamed.plan.tiers.count("disk") == n - 1, streamed.plan.tiers
    for prompt in (IDS[:8], IDS):  # decode-sized and prefill-sized passes
        assert torch.equal(resident.logits(prompt), streamed.logits(prompt))
    greedy = dict(max_tokens=8, temperature=0)
    assert [e.id for e in resident.generate(IDS[:6], **greedy)] == \
        [e.id for e in streamed.generate(IDS[:6], **greedy)]
    resident.close()
    streamed.close()


@pytest.mark.slow
def test_a_family_model_is_a_speculative_target(family_file, tmp_path):
    """Speculative decoding with a lower-bit copy of the same family as the draft gives the
    plain greedy tokens at "exact" (lossless). How many drafted tokens random weights accept
    is not the point; that the draft ran is."""
    arch, path = family_file
    with slipstream.load(path, device="cpu", ctx=128, precision="exact",
                         draft=slipstream.SelfDraft(lowbit="Q4_0")) as model:
        plain = [e.id for e in model.generate(IDS[:6], max_tokens=16, temperature=0,
                                              draft=False)]
        gen = model.generate(IDS[:6], max_tokens=16, temperature=0)
        spec = [e.id for e in gen]
        assert spec == plain
        assert gen.speculation["draft_forwards"] > 0


def test_info_lists_every_family(capsys):
    from slipstream import cli

    assert cli.main(["info", "--families"]) == 0
    out = capsys.readouterr().out
    for f in FAMILIES:
        assert f.name in out
        for arch in f.architectures:
            assert arch in out


def test_an_unsupported_architecture_is_one_line_naming_it(tmp_path, capsys):
    from gguf import GGUFWriter

    from slipstream import cli

    path = tmp_path / "other.gguf"
    w = GGUFWriter(path, "phi2")  # an architecture llama.cpp knows and slipstream does not
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    assert cli.main(["info", "-m", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "'phi2'" in err[0] and all(arch in err[0] for arch in ARCHITECTURES)
