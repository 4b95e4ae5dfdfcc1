"""Qwen3.5 (`qwen35`) and Qwen3.5-MoE (`qwen35moe`): the whole model at precision="exact"
against llama.cpp (llama-cpp-python) on a float32 copy and against transformers
(hf_reference builds Qwen3_5(Moe)ForCausalLM from the file's tensors: transformers' GGUF
reader does not read these architectures), prefill and decode; negative controls (the decay's
sign flipped, the conv left out, the value heads grouped instead of tiled, the shared
expert's gate left out) must leave the tolerance by far. The recurrent state beside the KV
cache: decode one token at a time gives the prefill's logits, truncate restarts the states and
generation goes on as from a fresh prefill, streamed layers give the resident bits, and
speculation is refused naming the reason.

The synthetic files are written by `slipstream synth --arch qwen35|qwen35moe`: every second
layer full attention (Qwen3.5: every fourth), 4 key heads and 8 value heads of 32 in the
linear layers (value head h reads key head h mod 4), a 4-tap conv, RoPE on a quarter of each
64-wide head; qwen35moe with 16 experts (4 used) and a gated shared expert."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import slipstream
from helpers import (assert_decisive_top1, assert_disk_streaming_gives_resident_bits,
                     cpu_engine, cpu_stages, file_config, rel64)
from llamacpp_ref import rel_err
from routing_replay import assert_same_decisive_choices, recorded_routing, replayed_routing
from slipstream.errors import InvalidMetadata, MissingMetadata, RecurrentState, \
    UnsupportedArchitecture
from slipstream.model import delta_net
from slipstream.model.families.qwen35 import rope_sections_cover
from slipstream.model.step import tree_step
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.runtime.engine import Engine
from slipstream.synth import SHAPES, write_synth

ARCHS = ("qwen35", "qwen35moe")
IDS = list(range(7, 300, 11))  # 27 tokens
N_LAYERS = 4  # two linear-attention layers, two full-attention ones
# float32 weights on both sides: measured 1.4e-6 (qwen35) and 1.8e-6 (qwen35moe) against
# llama.cpp's float32 copy (llama-cpp-python 0.3.36), 1e-3 asked as for every family; each
# negative control measured 0.3 or more (a flipped decay: NaN, the state grows without bound)
F32_REL_TOL = 1e-3
DECISIVE_GAP = 5e-3
# against transformers: its l2norm's eps is 1e-6 where llama.cpp (and slipstream) take the
# file's RMS epsilon (1e-5 here)
EXACT_REL_TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def qwen_file(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    path = write_synth(d / f"{arch}.gguf", "tiny", "Q8_0", n_layers=N_LAYERS, arch=arch,
                       from_floats=True, seed=3, std=0.15)
    return arch, path


@pytest.fixture(scope="module")
def f32_file(qwen_file, tmp_path_factory) -> tuple[str, Path]:
    from slipstream.quant.requantize import requantize

    arch, path = qwen_file
    return arch, requantize(path, tmp_path_factory.mktemp("f32") / f"{arch}-f32.gguf", "F32")


@pytest.fixture(scope="module")
def llamacpp_ref(f32_file) -> torch.Tensor:
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import llamacpp_logits

    return llamacpp_logits(f32_file[1], IDS)


def _variant(engine: Engine, **cfg_change) -> Engine:
    """The engine's weights under a changed config, with fresh caches."""
    cfg = dataclasses.replace(engine.cfg, **cfg_change)
    return Engine(cfg, engine.weights, cpu_stages(cfg, engine.weights, 256))


def _negative_controls(engine: Engine, ref: torch.Tensor, monkeypatch) -> dict[str, float]:
    """The logits' error against `ref` with each piece wrong: the decay's sign flipped, the
    conv left out, the value heads grouped (h // 2) instead of tiled (h mod 4), the shared
    expert's gate left out (qwen35moe)."""
    errs = {}
    flipped = dataclasses.replace(engine.weights, layers=[
        dataclasses.replace(w, ssm_a=-w.ssm_a) if w.ssm_a is not None else w
        for w in engine.weights.layers])
    errs["decay_sign"] = rel_err(Engine(engine.cfg, flipped, cpu_stages(
        engine.cfg, flipped, 256)).forward(IDS, all_logits=True), ref)
    with monkeypatch.context() as m:  # the conv left out: its input passes through
        m.setattr(delta_net, "causal_conv", lambda mixed, conv_state, taps: mixed)
        engine.reset()
        errs["conv"] = rel_err(engine.forward(IDS, all_logits=True), ref)
    with monkeypatch.context() as m:  # value head h reading key head h // (heads / groups)
        m.setattr(delta_net, "key_heads",
                  lambda heads, groups, device: torch.arange(heads) // (heads // groups))
        engine.reset()
        errs["grouped"] = rel_err(engine.forward(IDS, all_logits=True), ref)
    if engine.cfg.n_experts:
        layers = [dataclasses.replace(w, moe=dataclasses.replace(
            w.moe, shared=dataclasses.replace(w.moe.shared, gate=None)))
            for w in engine.weights.layers]
        weights = dataclasses.replace(engine.weights, layers=layers)
        plain = Engine(engine.cfg, weights, cpu_stages(engine.cfg, weights, 256))
        errs["shared_gate"] = rel_err(plain.forward(IDS, all_logits=True), ref)
    engine.reset()
    return errs


def test_a_synthesized_file_holds_the_qwen35_layers(tmp_path):
    for arch in ARCHS:
        path = write_synth(tmp_path / f"{arch}.gguf", "tiny", "Q8_0", n_layers=4, arch=arch)
        cfg = file_config(path)
        assert cfg.recurrent_layers == (True, False, True, False)
        assert cfg.layer(0).recurrent and cfg.layer(1).full_attn
        assert (cfg.ssm_conv_kernel, cfg.ssm_state, cfg.ssm_groups, cfg.ssm_heads) == \
            (4, 32, 4, 8)
        assert cfg.attn_gate and cfg.qk_norm and cfg.rope_style == "neox"
        assert cfg.rope_dim == cfg.head_dim // 4
        gf = GGUFFile(path)
        names = set(gf.tensors)
        assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_qkv.weight",
                "blk.1.attn_q.weight", "blk.1.attn_q_norm.weight"} <= names
        assert "blk.0.attn_q.weight" not in names and "blk.1.ssm_a" not in names
        assert tuple(gf.tensors["blk.1.attn_q.weight"].shape) == (2 * 4 * 64, 256)
        assert gf.tensors["blk.0.ssm_conv1d.weight"].ggml_type == Q.F32
        if arch == "qwen35moe":
            assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn, cfg.shexp_ffn) == \
                (16, 4, 256, 256)
            assert cfg.shexp_gate and "blk.1.ffn_gate_inp_shexp.weight" in names
        gf.close()


def test_the_35b_a3b_shape_is_qwen35_35b_a3b():
    """`synth --arch qwen35moe --shape 35b-a3b` reads back as Qwen3.5-35B-A3B's config.json
    says: 40 layers, every fourth full attention, 16 + 32 linear heads of 128, 16 query heads
    of 256 over 2 key/value heads, RoPE on 64 of them, 256 experts of 512 (8 used)."""
    from slipstream.synth import synth_config

    cfg = synth_config(SHAPES["35b-a3b"], "qwen35moe")
    assert cfg.n_layers == 40 and sum(cfg.recurrent_layers) == 30
    assert not cfg.layer(3).recurrent and cfg.layer(4).recurrent
    assert (cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_conv_kernel) == \
        (16, 32, 128, 4)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == (16, 2, 256, 64)
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn, cfg.shexp_ffn) == \
        (256, 8, 512, 512)


def test_info_lists_qwen35(capsys):
    from slipstream import cli

    assert cli.main(["info", "--families"]) == 0
    out = capsys.readouterr().out
    assert "qwen35" in out and "qwen35moe" in out


def test_rope_sections_must_cover_every_pair():
    """Qwen3.5's [11, 11, 10, 0] over 32 pairs and the tiny shape's [3, 3, 2, 0] over 8 give
    every pair a text position; sections leaving pairs to the fourth section do not."""
    assert rope_sections_cover([11, 11, 10, 0], 32)
    assert rope_sections_cover([3, 3, 2, 0], 8)
    assert not rope_sections_cover([2, 2, 2, 2], 8)
    assert not rope_sections_cover([0, 0, 0, 0], 8)


@pytest.mark.parametrize("key", ["qwen35.ssm.state_size", "qwen35.ssm.conv_kernel",
                                 "qwen35.rope.dimension_sections"])
def test_missing_qwen35_metadata_is_named(tmp_path, key):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen35")
    gf = GGUFFile(path)
    md = dict(gf.metadata)
    del md[key]
    with pytest.raises(MissingMetadata, match=key):
        ModelConfig.from_metadata(md, set(gf.tensors))


@pytest.mark.parametrize("change,error,match", [
    ({"qwen35.ssm.inner_size": 128}, InvalidMetadata, "inner_size' 128"),
    ({"qwen35.ssm.group_count": 3}, InvalidMetadata, "not a multiple"),
    ({"qwen35.rope.dimension_sections": [2, 2, 2, 2]}, UnsupportedArchitecture, "fourth"),
    ({"qwen35.attention.recurrent_layers": [True]}, InvalidMetadata, "recurrent_layers"),
])
def test_bad_qwen35_metadata_is_named(tmp_path, change, error, match):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen35")
    gf = GGUFFile(path)
    with pytest.raises(error, match=match):
        ModelConfig.from_metadata({**gf.metadata, **change}, set(gf.tensors))


def test_qwen35moe_without_experts_is_refused(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen35moe")
    gf = GGUFFile(path)
    md = dict(gf.metadata)
    del md["qwen35moe.expert_count"]
    with pytest.raises(MissingMetadata, match="qwen35moe.expert_count"):
        ModelConfig.from_metadata(md, set(gf.tensors))


def test_decode_one_token_at_a_time_gives_the_prefill_logits(tmp_path):
    """The fast check of the states beside the cache: a prompt prefilled in one pass and the
    same prompt as a prefill of 3 then one token at a time agree (float32 rounding apart)."""
    path = write_synth(tmp_path / "q.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen35",
                       from_floats=True, seed=1, std=0.15)
    engine = cpu_engine(path, precision="exact")
    ids = IDS[:9]
    whole = engine.forward(ids, all_logits=True)
    engine.reset()
    stepped = torch.cat([engine.forward(ids[:3], all_logits=True)]
                        + [engine.forward(ids[i:i + 1]) for i in range(3, len(ids))])
    assert rel64(stepped, whole) < 1e-5
    assert torch.equal(stepped.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("T,chunk", [(2, 0), (64, 0), (100, 0), (130, 16)])
def test_chunked_recurrence_is_the_token_by_token_one(T, chunk):
    """The chunked gated delta rule (prefill) gives the token-by-token one's outputs and final
    state, over whole and ragged chunks, from a state that is not zero; with the decay's sign
    flipped it does not (a chunked form that ignored the decay would pass the rest)."""
    g = torch.Generator().manual_seed(T)
    H, S = 4, 16
    q = torch.nn.functional.normalize(torch.randn(T, H, S, generator=g), dim=-1) / 4
    k = torch.nn.functional.normalize(torch.randn(T, H, S, generator=g), dim=-1)
    v = torch.randn(T, H, S, generator=g)
    decay, beta = -2 * torch.rand(T, H, generator=g), torch.rand(T, H, generator=g)
    s0 = 0.1 * torch.randn(H, S, S, generator=g)
    s_steps, s_chunks, s_wrong = s0.clone(), s0.clone(), s0.clone()
    ref = delta_net.delta_rule_steps(q, k, v, decay, beta, s_steps)
    out = delta_net.delta_rule_chunked(q, k, v, decay, beta, s_chunks, chunk)
    assert rel64(out, ref) < 1e-5 and rel64(s_chunks, s_steps) < 1e-5
    wrong = delta_net.delta_rule_chunked(q, k, v, -decay, beta, s_wrong, chunk)
    assert not rel64(wrong, ref) < 1e-2


@pytest.mark.slow  # (a float32 copy written and loaded by llama.cpp: 3 to 5 s)
def test_float32_copy_matches_llamacpp(f32_file, llamacpp_ref, monkeypatch):
    """All positions within 1e-3 of llama.cpp with its top-1 wherever it is decisive, prefill
    and decode one token at a time; each negative control far outside."""
    arch, path = f32_file
    engine = cpu_engine(path, precision="exact")
    ours = engine.forward(IDS, all_logits=True)
    assert rel64(ours, llamacpp_ref) < F32_REL_TOL
    assert_decisive_top1(llamacpp_ref, ours, DECISIVE_GAP)
    engine.reset()
    stepped = torch.cat([engine.forward(IDS[:5], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(5, len(IDS))])
    assert rel64(stepped, llamacpp_ref) < F32_REL_TOL
    assert rel64(stepped, ours) < F32_REL_TOL
    assert_decisive_top1(llamacpp_ref, stepped, DECISIVE_GAP)
    for piece, err in _negative_controls(engine, llamacpp_ref, monkeypatch).items():
        assert not err < 100 * F32_REL_TOL, (piece, err)  # (NaN counts as far outside)


@pytest.mark.slow  # (importing transformers' Qwen3.5 modules takes seconds)
def test_logits_match_transformers(qwen_file, monkeypatch):
    pytest.importorskip("transformers")
    from hf_reference import reference_model

    arch, path = qwen_file
    hf = reference_model(path, file_config(path))
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    engine = cpu_engine(path, precision="exact")
    ours = engine.forward(IDS, all_logits=True)
    assert rel64(ours, ref) < EXACT_REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    for piece, err in _negative_controls(engine, ref, monkeypatch).items():
        assert not err < 100 * EXACT_REL_TOL, (piece, err)


def test_truncate_restarts_the_states(qwen_file):
    """After a prompt and some decoded tokens, truncating back (past the prompt's snapshot,
    into the prompt, to nothing) and going on gives the logits of a fresh prefill of what
    is kept plus the new tokens; the states cannot be rolled back by the cache alone."""
    _, path = qwen_file
    engine = cpu_engine(path, precision="exact")
    fresh = engine.forward(IDS, all_logits=True)
    for keep in (20, 9, 0):  # past the prompt's snapshot, into the prompt, nothing
        engine.reset()
        engine.forward(IDS[:10], all_logits=True)  # a prompt: its states are a snapshot
        for t in IDS[10:22]:  # decoded tokens, and different ones in place of IDS[22:]
            engine.forward([t])
        engine.forward([5, 6])
        engine.truncate(keep)
        assert engine.length == keep
        again = engine.forward(IDS[keep:], all_logits=True)
        assert rel_err(again, fresh[keep:]) < 1e-5, keep
    with pytest.raises(RecurrentState, match="cannot roll the cache back"):
        engine.stages[0].kv.truncate(3)


def test_a_prefill_stopped_between_layers_leaves_the_states_as_they_were(qwen_file):
    """Ctrl-C between layers (Engine.between_layers raising) keeps the context of the passes
    before: the linear-attention states are put back, so the next tokens' logits are a
    fresh run's."""
    _, path = qwen_file
    engine = cpu_engine(path, precision="exact")
    fresh = engine.forward(IDS, all_logits=True)
    engine.reset()
    engine.forward(IDS[:6], all_logits=True)
    calls = []

    def stop() -> None:
        calls.append(1)
        if len(calls) == 3:  # after the first two layers of the next pass
            raise KeyboardInterrupt

    engine.between_layers = stop
    with pytest.raises(KeyboardInterrupt):
        engine.forward([9, 10, 11])
    engine.between_layers = None
    assert engine.length == 6
    assert rel_err(engine.forward(IDS[6:], all_logits=True), fresh[6:]) < 1e-5


def test_speculation_is_refused_naming_the_reason(qwen_file):
    _, path = qwen_file
    engine = cpu_engine(path, precision="exact")
    with pytest.raises(RecurrentState, match="speculative decoding is not available"):
        engine.self_draft()
    engine.forward(IDS[:4])
    with pytest.raises(RecurrentState, match="appended in order"):
        engine.forward(IDS[4:7], step=tree_step([-1, 0, 0], 4, 4, torch.device("cpu")))
    with pytest.raises(RecurrentState, match="compact"):
        engine.compact([2, 3], 2)
    with pytest.raises(RecurrentState, match="speculative decoding is not available"):
        slipstream.load(path, device="cpu", ctx=64, draft=slipstream.SelfDraft(lowbit="Q4_0"))


def test_cuda_is_refused_naming_the_cpu(qwen_file):
    from slipstream.runtime.build import check_experts_device

    arch, path = qwen_file
    cfg = file_config(path)
    with pytest.raises(UnsupportedArchitecture, match=f"{arch} runs on the CPU only"):
        check_experts_device(cfg, torch.device("cuda"))
    check_experts_device(cfg, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_streamed_from_disk_gives_the_resident_bits(tmp_path, precision):
    """qwen35's layers read from disk per pass (their states live in the cache, not in the
    streamed weights) give the resident load's logits bit for bit, and its greedy tokens."""
    path = write_synth(tmp_path / "q.gguf", "tiny", "Q8_0", n_layers=N_LAYERS, arch="qwen35",
                       seed=3, std=0.15)
    assert_disk_streaming_gives_resident_bits(path, precision, IDS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_default_precision_decodes_as_exact_does(tmp_path, arch):
    """At the default precision (packed weights, 8-bit activations at decode, 16-bit at
    prefill) a Q4_K file's logits, prefill then decode, stay near precision="exact"'s on
    exact's routing (tests/routing_replay.py): measured 3.4e-3 prefill-then-decode (qwen35moe);
    on its own routing, 4 near-tied rows flipped and moved that to 1.4e-2. Its own choices
    agree with exact's wherever those were decisive."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=N_LAYERS, arch=arch,
                       seed=1)
    exact_engine = cpu_engine(path, precision="exact")

    def stepped(engine: Engine) -> torch.Tensor:
        engine.reset()
        return torch.cat([engine.forward(IDS[:20], all_logits=True)]
                         + [engine.forward(IDS[i:i + 1]) for i in range(20, len(IDS))])

    with recorded_routing() as whole_routes:
        exact = exact_engine.forward(IDS, all_logits=True)
    with recorded_routing() as step_routes:
        stepped(exact_engine)
    engine = cpu_engine(path)
    with replayed_routing(whole_routes) as own_whole:
        assert rel_err(engine.forward(IDS, all_logits=True), exact) < 3e-3
    with replayed_routing(step_routes) as own_steps:
        got = stepped(engine)
    assert rel_err(got, exact) < 1e-2
    assert int((got.argmax(-1) != exact.argmax(-1)).sum()) <= 1
    assert_same_decisive_choices(whole_routes, own_whole)
    assert_same_decisive_choices(step_routes, own_steps)
    assert bool(whole_routes) == (arch == "qwen35moe")


@pytest.mark.slow  # (a float32 copy of real-width layers, 80 tokens each side: 40 to 80 s)
@pytest.mark.parametrize("arch", ARCHS)
def test_real_layer_shapes_match_llamacpp(tmp_path, arch):
    """Qwen3.5-35B-A3B's layers as they are (16 query heads of 256 over 2 key/value heads,
    RoPE on 64 of them over sections [11, 11, 10, 0], 16 key and 32 value heads of 128 in the
    linear layers, an 8192-channel conv), with 8 experts and a small vocabulary to stay
    light: a float32 copy against llama.cpp over 80 tokens (a prefill of two chunks, 64 and
    16) and decoded from token 30 on. Measured 3.8e-6 (qwen35moe) and 3.0e-6 (qwen35) on 60
    other tokens of these files, prefill and decode alike; llama.cpp's own run of the Q8_0
    files is 0.16 and 0.04 from its run of the float32 copies (its 8-bit activations)."""
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import llamacpp_logits
    from slipstream.quant.requantize import requantize

    shape = dataclasses.replace(SHAPES["35b-a3b"], vocab=2048, n_experts=8,
                                n_experts_used=2, ffn=1024)
    q8 = write_synth(tmp_path / f"{arch}.gguf", shape, "Q8_0", n_layers=4, arch=arch, seed=0,
                     from_floats=True, std=0.05)
    f32 = requantize(q8, tmp_path / f"{arch}-f32.gguf", "F32")
    q8.unlink()
    ids = list(range(7, 2048, 25))[:80]
    ref = llamacpp_logits(f32, ids)
    engine = cpu_engine(f32, precision="exact")
    assert rel64(engine.forward(ids, all_logits=True), ref) < F32_REL_TOL
    engine.reset()
    stepped = torch.cat([engine.forward(ids[:30], all_logits=True)]
                        + [engine.forward(ids[i:i + 1]) for i in range(30, len(ids))])
    assert rel64(stepped, ref) < F32_REL_TOL
    assert_decisive_top1(ref, stepped, DECISIVE_GAP)
