"""Each model family against Hugging Face transformers loading the same synthetic GGUF
(dequantized, float32), and through every memory tier slipstream has on CPU: resident, streamed
from disk (whole layers at "exact", packed images at "fast"), and as a speculative target.

The files are written by `slipstream synth --arch FAMILY`'s code with random weights of the
family's layer (model.families), std 0.15 so that attention is far from uniform and a missing
or misplaced piece of the block shows in the logits (each family has a negative control)."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

import slipstream
from helpers import assert_disk_streaming_gives_resident_bits, cpu_engine, cpu_stages
from hf_reference import reference_logits as file_model_logits, reference_model
from slipstream.errors import GGUFError
from slipstream.model.families import ARCHITECTURES, FAMILIES, BlockTraits, family_for
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.runtime.engine import Engine
from slipstream.synth import SHAPES, synth_config, write_synth
from slipstream.weights.loader import load_weights

transformers = pytest.importorskip("transformers")

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary: past the tiny shape's
# 16-position sliding window
CTX = 256  # the engines' context: within the synthesized LongRoPE files' original 512
# float32 weights on both sides (precision="exact"): measured below 6e-6 on these files
EXACT_REL_TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Reference:
    """How transformers builds a family's reference, and the pieces beyond the family's
    BlockTraits whose negative control must break the logits."""

    # what transformers' GGUF reader needs told beside the file (None: it cannot read the
    # family as slipstream does, and hf_reference builds the model from a config)
    gguf_kwargs: dict | None = None
    controls: tuple[str, ...] = ()


# The families beyond Llama's. transformers' GGUF reader takes Qwen3's head size from the model
# class's default (128), not from qwen3.attention.key_length, and Gemma 3's query scale from
# query_pre_attn_scalar (default 256), which GGUF files do not hold. It reads neither Phi-3's
# LongRoPE factors nor its partial rotary.
NEW_FAMILIES = {
    "qwen3": Reference({"head_dim": 64}),
    "gemma3": Reference({"head_dim": 64, "query_pre_attn_scalar": 64},
                        ("embed_scale", "sliding_window")),
    "phi3": Reference(None, ("sliding_window", "rope_attn_factor", "rope_dim", "rope_factors")),
    "mistral3": Reference(None, ("attn_temp_scale", "rope_scaling")),
    "olmo2": Reference(None),
    "glm4": Reference(None, ("rope_dim",)),
    "cohere2": Reference(None, ("sliding_window", "logit_scale")),
    # (its reusing layers have no key/value weights, and its sliding layers' heads and RoPE
    # are their own: neither can be turned back into the Llama block's)
    "gemma4": Reference(None, ("embed_scale", "sliding_window", "final_softcap",
                               "per_layer_dim", "layer_scale", "rope_factors")),
}
# Traits whose Llama value needs weights the family's files lack or shape otherwise (OLMo 2
# has no pre-norm weights, and its whole-projection q/k norms cannot norm one head; Cohere 2
# has no FFN norm to run its FFN after attention): no engine runs them, and their family's
# other traits' controls stand for them
NO_CONTROL = {"pre_norms", "qk_norm_whole", "parallel"}
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
    kwargs = NEW_FAMILIES[arch].gguf_kwargs
    if kwargs is None:
        return file_model_logits(path, IDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0]


def test_every_family_is_listed_once():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    for arch in ARCHITECTURES:
        assert arch in family_for(arch).architectures
    assert set(NEW_FAMILIES) <= set(ARCHITECTURES)


def without(engine: Engine, piece: str) -> Engine:
    """`engine`'s model with one of its family's pieces back to the Llama block's: a
    BlockTraits field or a ModelConfig field to its default, the RoPE over the whole head
    ("rope_dim"), no frequency divisors ("rope_factors") or no YaRN ("rope_scaling"). Same
    weights, fresh caches."""
    cfg, weights = engine.cfg, engine.weights
    if piece == "rope_dim":  # (the divisors, one per rotated pair, go with it)
        cfg = dataclasses.replace(cfg, rope_dim=cfg.head_dim)
        weights = dataclasses.replace(weights, rope_freqs=None, rope_freqs_long=None)
    elif piece == "rope_scaling":  # plain RoPE: no YaRN
        cfg = dataclasses.replace(cfg, rope_scaling="none", rope_scale=1.0)
    elif piece == "rope_factors":
        weights = dataclasses.replace(weights, rope_freqs=None, rope_freqs_long=None)
    else:
        default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}[piece]
        cfg = dataclasses.replace(cfg, **{piece: default})
    return Engine(cfg, weights, cpu_stages(cfg, weights, CTX))


@pytest.mark.slow
def test_logits_match_transformers(family_file, reference_logits):
    arch, path = family_file
    engine = cpu_engine(path, ctx=CTX, precision="exact")
    ours = engine.forward(IDS, all_logits=True)
    assert rel_err(ours, reference_logits) < EXACT_REL_TOL
    assert torch.equal(ours.argmax(-1), reference_logits.argmax(-1))
    # one token at a time through the KV cache: the CPU decode path of the family's block
    engine.reset()
    stepped = torch.cat([engine.forward(IDS[:5], all_logits=True)]
                        + [engine.forward(IDS[i:i + 1]) for i in range(5, len(IDS))])
    assert rel_err(stepped, reference_logits) < EXACT_REL_TOL
    # Negative control: the same weights without one of the family's pieces must be clearly
    # wrong, or the comparison above could not tell the family's block from Llama's
    llama = BlockTraits()
    traits = family_for(arch).traits
    changed = [f.name for f in dataclasses.fields(traits)
               if getattr(traits, f.name) != getattr(llama, f.name)]
    pieces = [p for p in changed if p not in NO_CONTROL] + list(NEW_FAMILIES[arch].controls)
    assert pieces, f"{arch}: a family beyond Llama's differs from it in at least one piece"
    for piece in pieces:
        err = rel_err(without(engine, piece).forward(IDS, all_logits=True), reference_logits)
        # (OLMo 2 without its post-norms overflows: NaN is as wrong as it gets)
        assert math.isnan(err) or err > 100 * EXACT_REL_TOL, piece


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_streamed_from_disk_gives_the_resident_bits(family_file, tmp_path, precision):
    arch, path = family_file
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert_disk_streaming_gives_resident_bits(copy, precision, IDS)


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


@pytest.mark.parametrize("arch", sorted(NEW_FAMILIES))
def test_a_synthesized_file_holds_the_family_layer(arch, tmp_path):
    """The fast check of every family: `slipstream synth --arch` writes the tensors its
    LayerSpec names, with its shapes, and ModelConfig reads the family's metadata back."""
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1, arch=arch)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    assert cfg.architecture == arch
    spec = family_for(arch).layer
    layer = {n.removeprefix("blk.0."): tuple(t.shape) for n, t in gf.tensors.items()
             if n.startswith("blk.0.")}
    assert layer == spec.shapes(cfg)
    traits = family_for(arch).traits
    for f in dataclasses.fields(traits):
        assert getattr(cfg, f.name) == getattr(traits, f.name)


def test_phi3_metadata_and_longrope_divisors(tmp_path):
    """Phi-3's fused tensors, partial rotary, LongRoPE keys and the choice of divisors by
    context, as llama.cpp makes it: the long set only past the original context."""
    path = write_synth(tmp_path / "phi3.gguf", "tiny", "Q8_0", n_layers=1, arch="phi3")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    assert (cfg.head_dim, cfg.rope_dim, cfg.sliding_window, cfg.rope_ctx_orig) == (64, 48, 16, 512)
    assert cfg.rope_attn_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(512)))
    assert tuple(gf.tensors["blk.0.attn_qkv.weight"].shape) == (256 + 2 * 128, 256)
    assert tuple(gf.tensors["blk.0.ffn_up.weight"].shape) == (2 * 512, 256)
    weights = load_weights(gf, cfg, torch.device("cpu"), Precision.of("exact", torch.device("cpu")))
    layer = weights.layers[0]
    assert layer.attn_q is None and layer.ffn_gate is None
    assert layer.attn_qkv.out_features == 512 and layer.ffn_gate_up.out_features == 1024
    short, long = weights.rope_freqs_for(512), weights.rope_freqs_for(513)
    assert short.shape == long.shape == (24,)
    assert float(short.max()) == pytest.approx(3.0) and float(long.max()) == pytest.approx(16.0)


@pytest.mark.parametrize("shape,arch,head,scale", [
    ("27b", "gemma3", 128, 1 / math.sqrt(5376 / 32)),  # query_pre_attn_scalar 168
    ("32b", "qwen3", 128, 1 / math.sqrt(128)),
])
def test_large_shapes_keep_their_head_size(shape, arch, head, scale):
    """Gemma-3-27B and Qwen3-32B heads are 128 wide, not hidden / heads (168, 80): the
    shapes' configs (what their files read back as; writing them is for a big machine)."""
    cfg = synth_config(SHAPES[shape], arch)
    assert (cfg.head_dim, cfg.rope_dim) == (head, head)
    assert cfg.attention_scale == pytest.approx(scale)
    q = family_for(arch).layer.shapes(cfg)["attn_q.weight"]
    assert q == (cfg.n_heads * head, cfg.hidden)


def test_synth_writes_a_separate_head_size(tmp_path):
    """A shape whose head size is not hidden / heads writes it as key_length, which
    ModelConfig reads back (the tiny shape with 32-wide heads)."""
    shape = dataclasses.replace(SHAPES["tiny"], head_dim=32)
    path = write_synth(tmp_path / "m.gguf", shape, "Q8_0", n_layers=1, arch="qwen3")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    assert cfg.head_dim == 32 and tuple(gf.tensors["blk.0.attn_q.weight"].shape) == (128, 256)


@pytest.mark.slow
def test_phi4_decodes_through_the_native_layer(tmp_path, monkeypatch):
    """Phi-3's fused tensors are the linears the CPU's native decode layer takes: without a
    sliding window (Phi-4), its decode tokens go through it, LongRoPE's scaled table and
    partial rotary included, and agree with the torch ops as two float32 summation orders
    do (the test of the Llama block's native layer, tests/model/test_cpu_native.py)."""
    from slipstream.model import cpu_native, llama

    path = write_synth(tmp_path / "phi3.gguf", "tiny", "Q4_K", n_layers=3, arch="phi3",
                       from_floats=True, std=0.1, seed=5)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(llama, "CPU_NATIVE", on)
        base = cpu_engine(path, ctx=64, precision="fast")
        cfg = dataclasses.replace(base.cfg, sliding_window=0)
        engine = Engine(cfg, base.weights, cpu_stages(cfg, base.weights, 64))
        engine.forward([3, 17, 99])
        logits = torch.cat([engine.forward([t]) for t in (11, 42, 500, 8, 1, 2, 3)])
        served = [isinstance(w.cpu_native, cpu_native.NativeLayer)
                  for w in engine.weights.layers]
        runs.append((logits, served))
    (a, served_on), (b, served_off) = runs
    if cpu_native.native.library() is None:
        pytest.skip("no C compiler: the native layer cannot build")
    assert all(served_on) and not any(served_off)
    assert float((a - b).abs().max()) < 0.02 * float(b.abs().max())


@pytest.mark.slow
def test_phi3_long_context_takes_the_long_divisors(tmp_path):
    """Past the original context (512 positions in the tiny shape), transformers rotates with
    LongRoPE's long divisors; so does slipstream in a context allocated past it, as llama.cpp
    chooses. A 530-token prompt through both, compared at its last positions."""
    path = write_synth(tmp_path / "phi3.gguf", "tiny", "Q8_0", n_layers=2, arch="phi3",
                       from_floats=True, seed=3, std=0.15)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    ids = [(7 + 11 * i) % 1000 for i in range(530)]
    with torch.no_grad():
        ref = reference_model(path, cfg)(torch.tensor([ids])).logits[0, -8:]
    engine = cpu_engine(path, ctx=600, precision="exact")
    ours = engine.forward(ids, all_logits=True)[-8:]
    assert rel_err(ours, ref) < EXACT_REL_TOL
    # the same context with the short divisors: clearly off
    weights = dataclasses.replace(engine.weights, rope_freqs_long=None)
    short = Engine(engine.cfg, weights, cpu_stages(engine.cfg, weights, 600))
    assert rel_err(short.forward(ids, all_logits=True)[-8:], ref) > 100 * EXACT_REL_TOL


def _gemma4_md(tmp_path, n_layers: int = 6) -> tuple[dict, set]:
    gf = GGUFFile(write_synth(tmp_path / "g4.gguf", "tiny", "Q8_0", n_layers=n_layers,
                              arch="gemma4"))
    return dict(gf.metadata), set(gf.tensors)


def test_gemma4_layers_differ_as_the_file_says(tmp_path):
    """A synthesized Gemma 4 (E2B's layout in small) reads back with its two layer shapes,
    its reusing layers and their sources (transformers' rule, llama.cpp's kv_layers - 2 /
    - 1), and each layer's tensors: the reusing layers hold no key or value projections."""
    md, names = _gemma4_md(tmp_path)
    cfg = ModelConfig.from_metadata(md, names)
    assert cfg.swa_layers == (True, True, False, True, True, False)
    assert [cfg.layer(i).head_dim for i in range(6)] == [64, 64, 128, 64, 64, 128]
    assert [cfg.layer(i).ffn for i in range(6)] == [512, 512, 512, 1024, 1024, 1024]
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 1, 1, 2]
    assert (cfg.per_layer_dim, cfg.final_softcap, cfg.attention_scale) == (256, 30.0, 1.0)
    assert "blk.3.attn_k.weight" not in names and "blk.2.attn_k.weight" in names
    assert tuple(GGUFFile(tmp_path / "g4.gguf").tensors["blk.2.attn_q.weight"].shape) == \
        (4 * 128, 256)
    spec = family_for("gemma4").layer.at(cfg.layer(4))
    assert [g.field for g in spec.linears][:2] == ["attn_q", "ffn_gate_up"]
    assert "attn_k_norm" not in spec.norms


def test_gemma4_reusing_layers_read_their_source_cache(tmp_path):
    """The KV cache gives a reusing layer its source's tensors (one allocation each), with
    the source's head shape; a stage boundary between the two is refused."""
    from slipstream.runtime.kv_cache import KVCache

    md, names = _gemma4_md(tmp_path)
    cfg = ModelConfig.from_metadata(md, names)
    kv = KVCache(cfg, 32, torch.device("cpu"), torch.float32)
    assert kv.layer(3)[0] is kv.layer(1)[0] and kv.layer(5)[1] is kv.layer(2)[1]
    assert kv.layer(0)[0].shape == (2, 32, 64) and kv.layer(2)[0].shape == (2, 32, 128)
    assert kv.nbytes == 2 * 2 * 32 * 4 * (64 + 64 + 128)  # k and v of the three sources
    with pytest.raises(ValueError, match="layer 1"):
        KVCache(cfg, 32, torch.device("cpu"), torch.float32, n_layers=3, first=3)


def test_gemma4_mixture_of_experts_needs_its_tensors(tmp_path):
    """A gemma4 file with experts (the 26B-A4B's keys) is a mixture of experts
    (tests/model/test_gemma4_moe.py): one without the router is refused naming it."""
    md, names = _gemma4_md(tmp_path, n_layers=1)
    md.update({"gemma4.expert_count": 128, "gemma4.expert_used_count": 8,
               "gemma4.expert_feed_forward_length": 704})
    with pytest.raises(GGUFError, match="missing tensor 'blk.0.ffn_gate_inp.weight'"):
        ModelConfig.from_metadata(md, names)


@pytest.mark.parametrize("pattern,match", [
    ([True] * 6, "marks it sliding"),
    ([True, False], "one bool per layer"),
    (6, "one bool per layer"),
])
def test_gemma4_bad_sliding_pattern_names_the_key(tmp_path, pattern, match):
    from slipstream.errors import InvalidMetadata

    md, names = _gemma4_md(tmp_path)
    md["gemma4.attention.sliding_window_pattern"] = pattern
    with pytest.raises(InvalidMetadata, match=match):
        ModelConfig.from_metadata(md, names)


def test_gemma4_sources_llamacpp_would_read_otherwise_are_refused(tmp_path):
    """Where the layer before the reusing ones is not global (or the one before it not
    sliding), llama.cpp's fixed sources and transformers' would differ: refused."""
    from slipstream.errors import UnsupportedArchitecture

    md, names = _gemma4_md(tmp_path)
    md["gemma4.attention.shared_kv_layers"] = 2  # sources 2 (global) and 3 (sliding)
    with pytest.raises(UnsupportedArchitecture, match="layers from 4 on"):
        ModelConfig.from_metadata(md, names)


def test_gemma4_values_from_the_key_projection(tmp_path):
    """A layer with attn_k but no attn_v (the 31B's and 26B-A4B's global layers, transformers'
    attention_k_eq_v) takes its values from the key projection: its q/k/v linear reads attn_k
    again for the value rows (checked against transformers and llama.cpp in
    test_gemma4_moe.py, whose files have such layers). A layer without attn_k is still
    missing a tensor."""
    md, names = _gemma4_md(tmp_path)
    cfg = ModelConfig.from_metadata(md, names - {"blk.2.attn_v.weight"})
    assert cfg.v_from_k_layers == (2,) and cfg.layer(2).v_from_k and not cfg.layer(1).v_from_k
    spec = family_for("gemma4").layer.at(cfg.layer(2))
    assert "attn_v.weight" not in {t.suffix for t in spec.tensors}
    assert next(g for g in spec.linears if g.field == "attn_qkv").parts == \
        ("attn_q", "attn_k", "attn_k")
    assert family_for("gemma4").layer.at(cfg.layer(1)).linears[0].parts == \
        ("attn_q", "attn_k", "attn_v")
    with pytest.raises(GGUFError, match="missing tensor 'blk.2.attn_k.weight'"):
        ModelConfig.from_metadata(md, names - {"blk.2.attn_k.weight"})


def test_a_family_whose_cuda_path_is_refused_names_the_cpu(tmp_path):
    """Gemma 4's CUDA path is refused before planning (runtime.build.check_experts_device,
    which needs only the device's type), naming the family and the CPU; Gemma 3 is not."""
    from slipstream.errors import UnsupportedArchitecture
    from slipstream.runtime.build import check_experts_device

    for arch, refused in (("gemma4", True), ("gemma3", False)):
        path = write_synth(tmp_path / f"{arch}.gguf", "tiny", "Q8_0", n_layers=6, arch=arch)
        gf = GGUFFile(path)
        cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
        gf.close()
        if refused:
            with pytest.raises(UnsupportedArchitecture, match="gemma4 runs on the CPU only"):
                check_experts_device(cfg, torch.device("cuda"))
        else:
            check_experts_device(cfg, torch.device("cuda"))
        check_experts_device(cfg, torch.device("cpu"))


def test_gemma4_layer_skip_keeps_the_layers_whose_cache_others_read(tmp_path):
    """Layers 1 and 2 of this Gemma 4 write the keys and values layers 3-5 read: a layer skip
    never chooses them, and setting them by hand is refused, where skipping them would leave
    their readers attending to a cache nothing writes."""
    from slipstream.runtime import layer_skip

    md, names = _gemma4_md(tmp_path)
    cfg = ModelConfig.from_metadata(md, names)
    assert cfg.kv_sources() == {1, 2}
    # layers 1 and 2 the most redundant by similarity: still kept
    sims = [0.1, 0.99, 0.98, 0.5, 0.6, 0.2]
    assert layer_skip.choose(sims, k=2, keep=cfg.kv_sources()) == {3, 4}
    with pytest.raises(ValueError, match="nor 2 whose keys and values later layers read"):
        layer_skip.choose(sims, k=3, keep=cfg.kv_sources())


@pytest.mark.slow
def test_gemma4_engine_refuses_to_skip_a_layer_whose_cache_others_read(tmp_path):
    _gemma4_md(tmp_path)
    with slipstream.load(tmp_path / "g4.gguf", device="cpu", ctx=64) as model:
        with pytest.raises(ValueError, match=r"cannot skip layers \[2\]: later layers read"):
            model.engine.skip = {2, 4}
        with pytest.raises(ValueError, match=r"cannot skip layers \[1\]"):
            model.engine.self_draft(frozenset({1}))
        model.engine.skip = {3, 4}  # readers themselves may go
