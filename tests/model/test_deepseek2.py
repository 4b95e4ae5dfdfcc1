"""DeepSeek-V3 (`deepseek2`): the whole model at precision="exact" against transformers
(hf_reference builds DeepseekV3ForCausalLM from the file's tensors, its kv_b_proj joined back
from attn_k_b and attn_v_b) and against llama.cpp (llama-cpp-python) on a float32 copy,
prefill and decode through the latent cache. Negative controls for the latent attention's
pieces: without YaRN's mscale on the scores, with NEOX pairing, without YaRN, and for the
routing's selection bias and shared expert: each must leave the tolerance by far.

The synthetic files are written by `slipstream synth --arch deepseek2`: a 256-wide query and
key/value latent, 4 heads of 64 unrotated and 32 rotated key dimensions and 64 value ones,
YaRN (factor 40, mscale_all_dim 1) over a 16-position original context so that the 27 tokens
cross it, the first layer dense, 16 experts in 4 groups (2 open), 4 used, sigmoid routing
with the selection bias, scaled by 2.5, one shared expert."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers import (assert_controls_miss, assert_prefill_and_decode_match, cpu_engine,
                     file_config, variant)
from llamacpp_ref import rel_err, unname
from slipstream.errors import InvalidMetadata, UnsupportedArchitecture
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.runtime.engine import Engine
from slipstream.runtime.kv_cache import KVCache
from slipstream.synth import write_synth

IDS = list(range(7, 300, 11))  # 27 tokens: past the 16-position original context
N_LAYERS = 4
# float32 weights on both sides: measured 1.1e-5 against transformers and 5.1e-6 (prefill),
# 3.9e-6 (decode) against llama.cpp's float32 copy (llama-cpp-python 0.3.36); the negative
# controls 0.56 (no selection bias) to 1.08 (NEOX pairing), without mscale 0.68
EXACT_REL_TOL = 1e-4
F32_REL_TOL = 1e-3
F32_DECISIVE_GAP = 5e-3


@pytest.fixture(scope="module")
def ds_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("deepseek2")
    return unname(write_synth(d / "deepseek2.gguf", "tiny", "Q8_0", n_layers=N_LAYERS,
                              arch="deepseek2", from_floats=True, seed=3, std=0.15),
                  "deepseek2")


def test_a_synthesized_file_holds_the_deepseek2_layers(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2")
    cfg = file_config(path)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.mla_k_head, cfg.mla_v_head) == \
        (256, 256, 96, 64)
    # the cache: one head of the latent and the rotated part
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == (1, 288, 32)
    assert cfg.rope_style == "normal" and cfg.rope_scaling == "yarn"
    mscale = 1 + 0.1 * math.log(40.0)
    assert cfg.rope_attn_factor == 1.0
    assert cfg.attention_scale == pytest.approx(mscale ** 2 / math.sqrt(96))
    assert (cfg.dense_lead, cfg.n_shared_experts, cfg.moe_gating) == (1, 1, "sigmoid")
    kinds = {n: t.ggml_type for n, t in GGUFFile(path).tensors.items()}
    assert kinds["blk.1.attn_k_b.weight"] == Q.F16 and "blk.0.ffn_gate.weight" in kinds
    assert "blk.1.ffn_gate_exps.weight" in kinds and "blk.0.ffn_gate_exps.weight" not in kinds


def test_info_shows_the_latent_and_the_experts(tmp_path, capsys, monkeypatch):
    from slipstream import cli

    monkeypatch.setenv("COLUMNS", "200")  # (rows unwrapped)
    assert cli.main(["info", "--families"]) == 0
    assert "deepseek2" in capsys.readouterr().out
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2")
    assert cli.main(["info", "-m", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "q latent 256, kv latent 256; heads 96 key / 64 value" in out
    assert "1 shared; the first 1 layer(s) dense" in out


@pytest.mark.parametrize("arch", ["deepseek2",
                                  pytest.param("deepseek2-lite", marks=pytest.mark.slow)])
def test_load_checks_pass_a_file_whose_dense_layer_has_no_selection_bias(tmp_path, arch):
    """slipstream.load's tensor-name checks count the optional selection bias only in the
    layers with experts (a dense first layer has none, and V2's files none at all)."""
    import slipstream

    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch=arch)
    with slipstream.load(path, device="cpu", ctx=64) as m:
        assert m.logits(IDS[:4]).shape[-1] == 1024


def test_the_cache_holds_the_latent_once(tmp_path):
    """The keys' tensor is the values' (model.mla reads the values out of the latent): one
    (1, ctx, kv_lora + rope) per layer, 288 numbers a token instead of the expanded
    4 * (96 + 64)."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2")
    cfg = file_config(path)
    kv = KVCache(cfg, 64, torch.device("cpu"), torch.float32)
    k, v = kv.layer(1)
    assert k is v and tuple(k.shape) == (1, 64, 288)
    assert kv.nbytes == cfg.n_layers * 64 * 288 * 4


def test_a_file_without_a_gating_function_routes_as_llamacpp_guesses(tmp_path):
    """No expert_gating_func: softmax (DeepSeek-V2's files), but sigmoid for 47 layers and a
    154880-token vocabulary (GLM-4.7-Flash's early files), as llama.cpp's loader decides."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2")
    md = {k: v for k, v in GGUFFile(path).metadata.items()
          if k not in ("deepseek2.expert_gating_func", "tokenizer.ggml.tokens")}
    assert ModelConfig.from_metadata(md).moe_gating == "softmax"
    glm = {**md, "deepseek2.block_count": 47, "deepseek2.vocab_size": 154880}
    assert ModelConfig.from_metadata(glm).moe_gating == "sigmoid"
    assert ModelConfig.from_metadata({**glm, "deepseek2.block_count": 46}).moe_gating == \
        "softmax"


def test_older_unsplit_files_and_query_temperatures_are_refused(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2")
    gf = GGUFFile(path)
    with pytest.raises(UnsupportedArchitecture, match="attn_kv_b"):
        ModelConfig.from_metadata(gf.metadata, {*gf.tensors, "blk.0.attn_kv_b.weight"})
    md = {**gf.metadata, "deepseek2.attention.temperature_scale": 0.1}
    with pytest.raises(UnsupportedArchitecture, match="temperature_scale' is 0.1"):
        ModelConfig.from_metadata(md, set(gf.tensors))


@pytest.mark.parametrize("key,value,match", [
    ("deepseek2.attention.value_length", 288, "not the latent cache's"),
    ("deepseek2.attention.head_count_kv", 4, "head_count_kv' is 4"),
])
def test_bad_mla_metadata_is_named(tmp_path, key, value, match):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2")
    gf = GGUFFile(path)
    with pytest.raises(InvalidMetadata, match=match):
        ModelConfig.from_metadata({**gf.metadata, key: value}, set(gf.tensors))


def _controls(engine: Engine) -> dict[str, Engine]:
    """The engine's model with each piece changed: the scores without YaRN's mscale, NEOX
    pairing, no YaRN, no selection bias, no shared expert."""
    cfg = engine.cfg
    return {"mscale": variant(engine, cfg_change={"attn_scale": 1 / math.sqrt(cfg.mla_k_head)}),
            "pairing": variant(engine, cfg_change={"rope_style": "neox"}),
            "yarn": variant(engine, cfg_change={"rope_scaling": "none", "rope_scale": 1.0}),
            "bias": variant(engine, moe_change={"selection_bias": None}),
            "shared": variant(engine, moe_change={"shared": None})}


@pytest.mark.slow
def test_logits_match_transformers(ds_file):
    pytest.importorskip("transformers")
    from hf_reference import reference_logits

    ref = reference_logits(ds_file, IDS)
    engine = cpu_engine(ds_file, precision="exact")
    # prefill, then decode one token at a time through the latent cache
    assert_prefill_and_decode_match(engine, IDS, ref, EXACT_REL_TOL)
    assert_controls_miss(_controls(engine), IDS, ref, 100 * EXACT_REL_TOL)


@pytest.mark.slow
def test_float32_copy_matches_llamacpp(ds_file, tmp_path):
    """Against llama.cpp on a float32 copy, prefill and decode, each piece's negative control
    far outside. test_vs_llamacpp.py compares the Q8_0 file itself."""
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import assert_matches, llamacpp_logits
    from slipstream.quant.requantize import requantize

    f32 = requantize(ds_file, tmp_path / "ds-f32.gguf", "F32")
    ref = llamacpp_logits(f32, IDS)
    engine = cpu_engine(f32, precision="exact")
    assert_matches(engine.forward(IDS, all_logits=True), ref, F32_REL_TOL, F32_DECISIVE_GAP)
    engine.reset()
    stepped = torch.cat([engine.forward(IDS[:5], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(5, len(IDS))])
    assert_matches(stepped, ref, F32_REL_TOL, F32_DECISIVE_GAP)
    assert_controls_miss(_controls(engine), IDS, ref, 10 * F32_REL_TOL)


def test_a_lite_file_has_no_query_latent_nor_selection_bias(tmp_path):
    """DeepSeek-V2-Lite's layout (--arch deepseek2-lite): queries from one projection,
    softmax routing (no expert_gating_func: llama.cpp's default for V2 files) without a
    selection bias, groups or scale, weights not renormalised, mscale_all_dim 0.707."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="deepseek2-lite")
    cfg = file_config(path)
    assert cfg.q_full and (cfg.moe_gating, cfg.selection_bias, cfg.moe_norm) == \
        ("softmax", False, False)
    assert (cfg.expert_groups, cfg.moe_scale, cfg.n_shared_experts) == (0, 1.0, 2)
    mscale = 1 + 0.1 * 0.707 * math.log(40.0)
    assert cfg.attention_scale == pytest.approx(mscale ** 2 / math.sqrt(96), rel=1e-6)
    names = set(GGUFFile(path).tensors)
    assert "blk.1.attn_q.weight" in names and "blk.1.attn_q_a.weight" not in names
    assert "blk.1.exp_probs_b.bias" not in names


@pytest.mark.slow
def test_lite_file_matches_llamacpp(tmp_path):
    """The V2-Lite layout against llama.cpp on a float32 copy (measured 4.3e-6 prefill,
    4.4e-6 decode); routed by sigmoid (measured 0.81), renormalised (0.11), or scored with
    mscale_all_dim 1 (0.15), it must not match."""
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import assert_matches, llamacpp_logits
    from slipstream.quant.requantize import requantize

    path = write_synth(tmp_path / "lite.gguf", "tiny", "Q8_0", n_layers=N_LAYERS,
                       arch="deepseek2-lite", from_floats=True, seed=3, std=0.15)
    path.write_bytes(path.read_bytes().replace(b"slipstream-synth-deepseek2-lite-",
                                               b"slipstream-synth-xxxxxxxxxxxxxx-"))
    f32 = requantize(path, tmp_path / "lite-f32.gguf", "F32")
    ref = llamacpp_logits(f32, IDS)
    engine = cpu_engine(f32, precision="exact")
    assert_matches(engine.forward(IDS, all_logits=True), ref, F32_REL_TOL, F32_DECISIVE_GAP)
    engine.reset()
    stepped = torch.cat([engine.forward(IDS[:5], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(5, len(IDS))])
    assert_matches(stepped, ref, F32_REL_TOL, F32_DECISIVE_GAP)
    v3_scale = (1 + 0.1 * math.log(40.0)) ** 2 / math.sqrt(engine.cfg.mla_k_head)
    assert_controls_miss({"sigmoid": variant(engine, moe_change={"gating": "sigmoid"}),
                          "normalize": variant(engine, moe_change={"normalize": True}),
                          "mscale": variant(engine, cfg_change={"attn_scale": v3_scale})},
                         IDS, ref, 10 * F32_REL_TOL)


@pytest.mark.slow
def test_default_precision_decodes_as_exact_does(tmp_path):
    """At the default precision (float16 weights, packed decode copies) a Q4_K file's logits,
    prefill then decode, stay near precision="exact"'s: measured 7.7e-3 at worst."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=3, arch="deepseek2",
                       seed=1)
    exact = cpu_engine(path, precision="exact").forward(IDS, all_logits=True)
    engine = cpu_engine(path)
    stepped = torch.cat([engine.forward(IDS[:20], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(20, len(IDS))])
    errs = [rel_err(stepped[i], exact[i]) for i in range(len(IDS))]
    assert max(errs) < 2e-2, errs
    assert torch.equal(stepped.argmax(-1), exact.argmax(-1))
