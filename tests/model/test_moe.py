"""Mixtures of experts: Qwen3-MoE (`qwen3moe`) and Mixtral (a `llama` file with experts).

The routing and the experts' sum against a plain torch reference written another way (every
expert run on every token, a dense weight matrix zero outside the top-k); each expert's
weights against gguf-py's dequantize of its slice of the 3-D tensor; the whole model's logits
at every position, prefill and decode, against transformers (its GGUF reader for Qwen3-MoE,
hf_reference's Mixtral built from the file's tensors) and llama.cpp, with negative controls
(the top-k weights not renormalised, the experts shifted by one) that must fail the same
comparisons. The synthetic files are written by `slipstream synth --arch qwen3moe|mixtral`'s
code, with random weights of std 0.15 as tests/model/test_families.py's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.quants import dequantize

import slipstream
from helpers import cpu_budget, cpu_engine
from llamacpp_ref import rel_err
from slipstream.errors import MissingMetadata, UnsupportedArchitecture
from slipstream.model.families import family_for
from slipstream.model.moe import MoeWeights, ResidentExperts, moe_ffn, route
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import synth_metadata, SHAPES, write_synth
from slipstream.weights.linear import DenseLinear
from slipstream.weights.loader import load_weights

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary
N_LAYERS = 6
# float32 weights on both sides (precision="exact"): measured 1.9e-6 (qwen3moe) and 5.5e-6
# (mixtral) against transformers, prefill and decode alike; the brief's bound is 1e-3
EXACT_REL_TOL = 1e-5
ARCHES = ["qwen3moe", "mixtral"]



# -- routing ----------------------------------------------------------------------------------

def _dense_reference(h, router, gate, up, down, k, normalize=True):
    """The MoE FFN computed densely: every expert on every token, then weighted by a
    (T, n_experts) matrix that is the softmax's top-k entries (renormalised) and 0 elsewhere."""
    probs = torch.softmax(h @ router.T, dim=-1)
    kth = probs.sort(dim=-1, descending=True).values[:, k - 1:k]
    gates = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    outs = torch.stack([(F.silu(h @ g.T) * (h @ u.T)) @ d.T for g, u, d in zip(gate, up, down)])
    return torch.einsum("te,teh->th", gates, outs.transpose(0, 1))


def _random_moe(n_experts=8, hidden=32, width=24, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    # logits of about unit spread: a softmax far from one-hot, so that renormalising matters
    router = torch.randn(n_experts, hidden, generator=g) / hidden ** 0.5
    gate, up = (torch.randn(n_experts, width, hidden, generator=g) / 5 for _ in range(2))
    down = torch.randn(n_experts, hidden, width, generator=g) / 5
    bank = ResidentExperts([DenseLinear(torch.cat((gt, u))) for gt, u in zip(gate, up)],
                           [DenseLinear(d) for d in down])
    return MoeWeights(router, bank, k), (router, gate, up, down)


@pytest.mark.parametrize("T", [1, 2, 17])
def test_moe_ffn_matches_a_dense_reference(T):
    moe, (router, gate, up, down) = _random_moe()
    h = torch.randn(T, 32, generator=torch.Generator().manual_seed(T))
    ref = _dense_reference(h, router, gate, up, down, moe.top_k)
    ours = moe_ffn(h, moe)
    assert rel_err(ours, ref) < 1e-5
    # the routing itself: the top-k of the softmax, descending, weights summing to 1
    weights, ids = route(h, router, moe.top_k)
    probs = torch.softmax(h @ router.T, dim=-1)
    assert torch.equal(ids, probs.topk(moe.top_k, dim=-1).indices)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    # negative controls: without renormalisation, or routed to the next expert's weights
    moe.normalize = False
    assert rel_err(moe_ffn(h, moe), ref) > 0.1
    assert rel_err(moe_ffn(h, moe), _dense_reference(h, router, gate, up, down, moe.top_k,
                                                      normalize=False)) < 1e-5
    moe.normalize = True
    shifted = MoeWeights(router, ResidentExperts(moe.experts.gate_up[1:] + moe.experts.gate_up[:1],
                                                 moe.experts.down[1:] + moe.experts.down[:1]),
                         moe.top_k)
    assert rel_err(moe_ffn(h, shifted), ref) > 0.1


def test_a_row_alone_agrees_with_the_row_in_a_batch():
    """A decode token (its own short path) and the same row inside a prefill batch add their
    experts in one order; with float32 dense experts the rows agree to the float32 rounding of
    the two matmul shapes (matrix-vector against matrix-matrix)."""
    moe, _ = _random_moe(seed=1)
    h = torch.randn(9, 32, generator=torch.Generator().manual_seed(5))
    batch = moe_ffn(h, moe)
    for t in range(9):
        assert torch.allclose(moe_ffn(h[t:t + 1], moe), batch[t:t + 1], rtol=1e-5, atol=1e-6)


# -- files, config, weights -------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHES)
def test_a_synthesized_file_holds_the_expert_layer(arch, tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1, arch=arch)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    assert cfg.architecture == ("llama" if arch == "mixtral" else arch)
    n, used, width = ((16, 4, 256) if arch == "qwen3moe" else (8, 2, 512))
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn, cfg.ffn) == (n, used, width, 512)
    layer = {k.removeprefix("blk.0."): tuple(t.shape) for k, t in gf.tensors.items()
             if k.startswith("blk.0.")}
    assert layer == family_for(cfg.architecture).moe_layer.at(cfg).shapes(cfg)
    assert layer["ffn_gate_exps.weight"] == (n, width, 256)
    assert layer["ffn_down_exps.weight"] == (n, 256, width)
    assert layer["ffn_gate_inp.weight"] == (n, 256)
    assert "ffn_gate.weight" not in layer and "ffn_down.weight" not in layer
    assert gf.tensors["blk.0.ffn_gate_inp.weight"].ggml_type.name == "F32"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K"])
def test_each_expert_dequantizes_to_its_slice(qtype, tmp_path):
    """Expert e's weights, as the engine multiplies them at "exact", are gguf-py's dequantize
    of the 3-D tensor's slice e, bit for bit (gate and up fused: gate rows first)."""
    # random blocks (no float weights to encode: any bytes of the format will do here), few
    # experts (each tensor under the 1 MiB past which synth cuts them from a 64 MiB pool)
    shape = dataclasses.replace(SHAPES["tiny"], n_experts=4, n_experts_used=2, expert_ffn=256)
    path = write_synth(tmp_path / "m.gguf", shape, qtype, n_layers=1, arch="qwen3moe", seed=2)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    cpu = torch.device("cpu")
    moe = load_weights(gf, cfg, cpu, Precision.of("exact", cpu)).layers[0].moe
    ref = {}
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.0.ffn_") and "norm" not in t.name:
            a = dequantize(t.data, t.tensor_type).astype(np.float32)
            ref[t.name] = torch.from_numpy(a.reshape([int(d) for d in reversed(t.shape)]))
    assert gf.tensors["blk.0.ffn_gate_exps.weight"].ggml_type.name == qtype
    F_ = cfg.expert_ffn
    for e in range(cfg.n_experts):
        gate_up = moe.experts.gate_up[e].weight
        assert torch.equal(gate_up[:F_], ref["blk.0.ffn_gate_exps.weight"][e])
        assert torch.equal(gate_up[F_:], ref["blk.0.ffn_up_exps.weight"][e])
        assert torch.equal(moe.experts.down[e].weight, ref["blk.0.ffn_down_exps.weight"][e])
    # negative control: a neighbouring expert's slice is another matrix
    assert not torch.equal(moe.experts.down[0].weight, ref["blk.0.ffn_down_exps.weight"][1])
    assert torch.equal(moe.router, ref["blk.0.ffn_gate_inp.weight"])


def test_packed_decode_experts_match_their_dense_weights(tmp_path):
    """At precision "fast" each expert decodes through a packed copy of its own slice: its
    one-row product agrees with the expert's dense weight as the packed kernels' bfloat16
    rounding allows, and not with the next expert's."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=1, arch="qwen3moe",
                       from_floats=True, seed=4, std=0.1)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    cpu = torch.device("cpu")
    experts = load_weights(gf, cfg, cpu, Precision.of("fast", cpu)).layers[0].moe.experts
    x = torch.randn(1, cfg.hidden, generator=torch.Generator().manual_seed(0))
    for e in (0, 7, 15):
        lin = experts.gate_up[e]
        assert lin.packed is not lin.dense, "no packed decode copy"
        packed = lin.packed(x).float()
        dense = x @ lin.dense.weight.float().T
        assert rel_err(packed, dense) < 2e-2
        other = x @ experts.gate_up[(e + 1) % cfg.n_experts].dense.weight.float().T
        assert rel_err(packed, other) > 0.5


@pytest.mark.parametrize("arch,key", [
    ("qwen3moe", "expert_count"),
    ("gpt-oss", "expert_count"), ("gpt-oss", "attention.sliding_window"),
    ("gpt-oss", "expert_feed_forward_length"),
    ("glm4moe", "expert_count"), ("glm4moe", "expert_feed_forward_length"),
    ("glm4moe", "expert_shared_count")])
def test_missing_expert_metadata_is_named(tmp_path, arch, key):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch=arch)
    gf = GGUFFile(path)
    md = dict(gf.metadata)
    del md[f"{arch}.{key}"]
    with pytest.raises(MissingMetadata, match=f"{arch}.{key}"):
        ModelConfig.from_metadata(md, set(gf.tensors))


def test_experts_in_a_family_without_them_are_refused(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1, arch="gemma3")
    md = dict(GGUFFile(path).metadata, **{"gemma3.expert_count": 8,
                                          "gemma3.expert_used_count": 2})
    with pytest.raises(UnsupportedArchitecture, match="'gemma3' with experts"):
        ModelConfig.from_metadata(md)


def test_expert_used_count_is_checked(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1, arch="mixtral")
    md = dict(GGUFFile(path).metadata, **{"llama.expert_used_count": 9})
    with pytest.raises(slipstream.errors.InvalidMetadata, match="expert_used_count.*9"):
        ModelConfig.from_metadata(md)


def test_per_expert_2d_tensors_are_refused_by_name(tmp_path):
    """Early Mixtral conversions stored each expert's matrices as 2-D tensors
    (blk.N.ffn_gate.E.weight): refused as such, not as a missing 3-D tensor."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1, arch="mixtral")
    gf = GGUFFile(path)
    names = {n for n in gf.tensors if "_exps" not in n}
    names |= {f"blk.0.ffn_{p}.{e}.weight" for p in ("gate", "up", "down") for e in range(8)}
    with pytest.raises(UnsupportedArchitecture, match="one tensor per expert.*ffn_gate.0"):
        ModelConfig.from_metadata(gf.metadata, names)


@pytest.mark.parametrize("arch", ["mixtral", "gpt-oss", "glm4moe", "deepseek2"])
def test_moe_runs_resident_only(tmp_path, arch, monkeypatch):
    """A mixture-of-experts model on a device other than the CPU and CUDA, on CUDA without
    SLIPSTREAM_CUDA_MOE=1 (or ever, for the families whose CUDA path is refused), or with some
    layers loaded, is refused with a clear error naming MoE, never run with wrong or partial
    experts; a RAM budget too small for the
    whole model places experts, not layers (tests/memory/test_expert_placement.py): no layer
    streams."""
    from slipstream.hybrid.split import layer_splittable
    from slipstream.runtime.build import check_experts_device
    from slipstream.weights.loader import TensorSource

    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=3, arch=arch)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    with pytest.raises(UnsupportedArchitecture, match="CPU or CUDA only"):
        check_experts_device(cfg, torch.device("meta"))
    check_experts_device(cfg, torch.device("cpu"))
    monkeypatch.delenv("SLIPSTREAM_CUDA_MOE", raising=False)
    with pytest.raises(UnsupportedArchitecture, match="CPU only|SLIPSTREAM_CUDA_MOE=1"):
        check_experts_device(cfg, torch.device("cuda"))
    monkeypatch.setenv("SLIPSTREAM_CUDA_MOE", "1")
    if arch in ("glm4moe", "deepseek2"):  # refused on CUDA whatever the switch
        with pytest.raises(UnsupportedArchitecture, match="CPU only"):
            check_experts_device(cfg, torch.device("cuda"))
    else:
        check_experts_device(cfg, torch.device("cuda"))  # every expert in VRAM (tests/gpu)
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedArchitecture, match="mixture-of-experts"):
        load_weights(gf, cfg, cpu, Precision.of("exact", cpu), resident_layers={0})
    assert not layer_splittable(TensorSource(gf), cfg, 0)
    budget = cpu_budget(path, whole=1, precision="exact")
    plan = slipstream.plan(path, device="cpu", ctx=64, precision="exact", measure=False,
                           placement=slipstream.Placement(ram_budget=budget))
    assert not plan.streamed_layers and plan.expert_slots is not None
    assert min(plan.expert_slots) < 8


def test_info_lists_the_moe_families(capsys, tmp_path):
    from slipstream import cli

    assert cli.main(["info", "--families"]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe" in out and "Mixtral" in out
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1, arch="qwen3moe")
    assert cli.main(["info", "-m", str(path)]) == 0
    assert "16, 4 per token, 256 wide" in capsys.readouterr().out


def test_synth_cli_writes_mixtral(tmp_path):
    from slipstream import cli

    out = tmp_path / "mixtral.gguf"
    assert cli.main(["synth", "--shape", "tiny", "--arch", "mixtral", "--layers", "1",
                     "--quant", "Q8_0", "-o", str(out)]) == 0
    gf = GGUFFile(out)
    assert gf.architecture == "llama" and gf.metadata["llama.expert_count"] == 8


def test_real_shapes_config():
    """Qwen3-30B-A3B's and Mixtral-8x7B's shapes read back with their experts (writing them
    is for a big machine)."""
    from slipstream.synth import synth_config

    q = synth_config(SHAPES["30b-a3b"], "qwen3moe")
    assert (q.n_experts, q.n_experts_used, q.expert_ffn, q.head_dim) == (128, 8, 768, 128)
    assert synth_metadata(SHAPES["30b-a3b"], "qwen3moe")[
        "qwen3moe.expert_feed_forward_length"] == 768
    m = synth_config(SHAPES["8x7b"], "mixtral")
    assert (m.architecture, m.n_experts, m.n_experts_used, m.expert_ffn) == ("llama", 8, 2, 14336)


# -- whole models against transformers and llama.cpp ------------------------------------------

@pytest.fixture(scope="module", params=ARCHES)
def moe_file(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    path = write_synth(d / f"{arch}.gguf", "tiny", "Q8_0", n_layers=N_LAYERS, arch=arch,
                       from_floats=True, seed=3, std=0.15)
    return arch, path


def _transformers_logits(arch: str, path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    if arch == "qwen3moe":
        # transformers' GGUF reader takes qwen3_moe's head size and expert width from the
        # class defaults (128, 768), not from key_length / expert_feed_forward_length; it
        # sets norm_topk_prob as llama.cpp runs the model
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, head_dim=64,
            moe_intermediate_size=256).eval()
        assert hf.config.norm_topk_prob
    else:
        from hf_reference import reference_logits

        return reference_logits(path, IDS)
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0]


def _with_moe(engine, change):
    """The engine's layers with each MoeWeights changed by `change` (same weights, fresh
    caches)."""
    from helpers import cpu_stages
    from slipstream.runtime.engine import Engine

    layers = [dataclasses.replace(w, moe=change(w.moe)) for w in engine.weights.layers]
    weights = dataclasses.replace(engine.weights, layers=layers)
    return Engine(engine.cfg, weights, cpu_stages(engine.cfg, weights, 256))


@pytest.mark.slow
def test_logits_match_transformers(moe_file):
    arch, path = moe_file
    ref = _transformers_logits(arch, path)
    engine = cpu_engine(path, precision="exact")
    ours = engine.forward(IDS, all_logits=True)  # prefill
    assert rel_err(ours, ref) < EXACT_REL_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    engine.reset()  # decode: one token at a time through the KV cache
    stepped = torch.cat([engine.forward(IDS[:5], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(5, len(IDS))])
    assert rel_err(stepped, ref) < EXACT_REL_TOL
    assert torch.equal(stepped.argmax(-1), ref.argmax(-1))
    # negative controls: the top-k weights left unnormalised; each token routed to the
    # experts one id further on
    flat = _with_moe(engine, lambda m: dataclasses.replace(m, normalize=False))
    assert rel_err(flat.forward(IDS, all_logits=True), ref) > 100 * EXACT_REL_TOL

    def shifted(m):
        bank = m.experts
        return dataclasses.replace(m, experts=ResidentExperts(bank.gate_up[1:] + bank.gate_up[:1],
                                                              bank.down[1:] + bank.down[:1]))

    assert rel_err(_with_moe(engine, shifted).forward(IDS, all_logits=True), ref) > \
        100 * EXACT_REL_TOL


# llama.cpp on a float32 copy of the file (tests/model/test_vs_llamacpp.py says why): measured
# 2.6e-6 (qwen3moe) and 8.4e-6 (mixtral) with llama-cpp-python 0.3.36. (qwen3moe is also
# among the architectures test_vs_llamacpp.py checks, quantized file included.)
F32_REL_TOL = 1e-3
F32_DECISIVE_GAP = 5e-3


@pytest.mark.slow
def test_logits_match_llamacpp(moe_file, tmp_path):
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import assert_matches, llamacpp_logits
    from slipstream.quant.requantize import requantize

    arch, path = moe_file
    f32 = requantize(path, tmp_path / "f32.gguf", "F32")
    assert len(GGUFFile(f32).tensors["blk.0.ffn_up_exps.weight"].shape) == 3
    ref = llamacpp_logits(f32, IDS)
    engine = cpu_engine(path, precision="exact")
    ours = engine.forward(IDS, all_logits=True)
    assert_matches(ours, ref, F32_REL_TOL, F32_DECISIVE_GAP)
    flat = _with_moe(engine, lambda m: dataclasses.replace(m, normalize=False))
    assert rel_err(flat.forward(IDS, all_logits=True), ref) > 100 * F32_REL_TOL


def test_auto_device_falls_back_to_the_cpu_for_a_cpu_only_model(tmp_path, monkeypatch):
    """device="auto" on a GPU machine runs a model whose CUDA path is refused (here a mixture of
    experts without SLIPSTREAM_CUDA_MOE=1) on the CPU, with a warning saying why, where
    device="cuda" refuses it: --device cpu runs it, so the default must not fail."""
    import slipstream.api as api
    from slipstream.errors import SlipstreamWarning

    monkeypatch.delenv("SLIPSTREAM_CUDA_MOE", raising=False)
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen3moe")
    # the machine's "auto" as a GPU machine resolves it; nothing here touches CUDA before the
    # fallback decides
    monkeypatch.setattr(api, "resolve_device", lambda name: torch.device(
        "cuda" if str(name) == "auto" else name))
    with pytest.warns(SlipstreamWarning, match="running on the CPU: .*SLIPSTREAM_CUDA_MOE=1"):
        plan = slipstream.plan(path, device="auto", ctx=64, measure=False)
    assert plan.device == "cpu"
    with pytest.warns(SlipstreamWarning, match="running on the CPU"):
        with slipstream.load(path, device="auto", ctx=64, precision="exact") as model:
            assert model.engine.device.type == "cpu"
            assert torch.isfinite(model.logits([1, 2, 3])).all()


@pytest.mark.slow
def test_a_mixture_of_experts_is_a_lossless_speculative_target_sized_by_its_experts(tmp_path):
    """Speculation over a mixture-of-experts target gives the plain greedy tokens, and its tree
    sizer models a pass by the experts its nodes read (8 of 16 per token here)."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen3moe",
                       from_floats=True, seed=3, std=0.15)
    with slipstream.load(path, device="cpu", ctx=128, precision="exact",
                         draft=slipstream.SelfDraft(lowbit="Q4_0")) as model:
        ids = [5, 9, 13, 2, 7, 11]
        plain = [e.id for e in model.generate(ids, max_tokens=12, temperature=0, draft=False)]
        gen = model.generate(ids, max_tokens=12, temperature=0)
        assert [e.id for e in gen] == plain
        assert gen.speculation["draft_forwards"] > 0
        (sizer,) = model.speculation.sizers.values()
        cfg = model.engine.cfg
        assert (sizer.experts.experts, sizer.experts.used) == (cfg.n_experts,
                                                               cfg.n_experts_used)
