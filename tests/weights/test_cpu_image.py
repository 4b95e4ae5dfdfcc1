"""weights.cpu_image: a streamed CPU layer's packed image, made into views, computes as the
resident layer does (the same bits), holds exactly the packed copies of the GGUF bytes, and is
the size the planner counts.

References: the resident layer (LayerBuilder at precision "fast", whose packed copies
tests/weights/test_cpu_packed.py checks against gguf.quants.dequantize), weights.cpu.pack_group
run on the file's bytes directly, and gguf.quants.dequantize itself.
"""

from __future__ import annotations

import gguf.quants
import pytest
import torch

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.model.llama import block_forward
from slipstream.model.families import spec_for
from slipstream.model.rope import RopeTable
from slipstream.model.step import append_step
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights import cpu_image
from slipstream.weights.cpu import PREFILL_KINDS, PackedDecodeLinear, kind_for, pack_group
from slipstream.weights.cpu.kinds import q4vnni_available
from slipstream.weights.linear import DenseLinear
from slipstream.weights.loader import LayerBuilder, TensorSource, raw_tensor

CPU = torch.device("cpu")
FAST = Precision.of("fast", CPU)
# (architecture, quant mix) -> the kind each decode linear takes. Q4_K_M's q/k/v mix Q4_K and
# Q6_K, whose layouts differ, so the resident layer decodes that group through its parts
# (pack_group fuses only parts of one layout; "parts": a PartsLinear, its kind naming each
# part's layout and rows); Q5_K takes q8vnni's records with float32 scales and zeros where the
# native library is there, else stays dense.
INT8 = kind_for(8)  # Q8_0's: q8vnni or int4pair
INT4 = kind_for(12)  # Q4_K (12)'s decode layout here: q4vnni with the native library, else int4pack
Q6 = kind_for(14)  # Q6_K (14)'s: q6vnni with the native library's VNNI loop, else int8pack
CASES = {
    ("llama", "Q4_K"): dict(attn_qkv=INT4, attn_output=INT4, ffn_gate_up=INT4, ffn_down=INT4),
    ("llama", "Q4_K_M"): dict(attn_qkv="parts", attn_output=INT4, ffn_gate_up=INT4,
                              ffn_down=Q6),
    ("llama", "Q8_0"): dict(attn_qkv=INT8, attn_output=INT8, ffn_gate_up=INT8, ffn_down=INT8),
    ("llama", "Q4_0"): dict(attn_qkv=INT4, attn_output=INT4, ffn_gate_up=INT4, ffn_down=INT4),
    ("llama", "Q5_K"): dict.fromkeys(("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"),
                                     kind_for(13) or "dense"),  # Q5_K (13)'s
    ("qwen2", "Q4_K"): dict(attn_qkv=INT4, attn_output=INT4, ffn_gate_up=INT4,
                            ffn_down=INT4),  # q/k/v biases
}
CB4 = kind_for(23)  # IQ4_XS (23)'s: cb4 with the native library, else dense
if CB4 is not None:  # the codebook formats: cb4 (MXFP4's grid named in the kind)
    CASES[("llama", "IQ4_XS")] = dict(attn_qkv=CB4, attn_output=CB4, ffn_gate_up=CB4,
                                      ffn_down=CB4)
    CASES[("llama", "MXFP4")] = dict(attn_qkv="cb4-mx", attn_output="cb4-mx",
                                     ffn_gate_up="cb4-mx", ffn_down="cb4-mx")
# the i-quant grid formats iq reads (the format named in the kind); no encoder writes them from
# floats, so their files hold random codes
IQ_MIXES = ("IQ3_XXS", "IQ3_S", "IQ1_M")
if kind_for(18) is not None:  # IQ3_XXS (18)'s: iq with the native library, else dense
    for mix in IQ_MIXES:
        CASES[("llama", mix)] = dict.fromkeys(
            ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"), f"iq-{mix}")


@pytest.fixture(scope="module", params=list(CASES), ids=lambda c: f"{c[0]}-{c[1]}")
def model(request, tmp_path_factory):
    arch, mix = request.param
    path = write_synth(tmp_path_factory.mktemp("cpuimg") / f"{arch}-{mix}.gguf", "tiny", mix,
                       n_layers=2, arch=arch, from_floats=mix not in IQ_MIXES, std=0.08, seed=5)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    yield request.param, gf, cfg
    gf.close()


def test_the_image_holds_each_linear_as_the_resident_decode_does(model):
    case, gf, cfg = model
    host, layout = cpu_image.cpu_image_of(gf, cfg, FAST, 1)
    assert {k: v[0].split(":")[0] for k, v in layout.linears.items()} == CASES[case]
    assert host.numel() == layout.nbytes == cpu_image.image_nbytes(gf, cfg, 1, FAST)
    # every tensor on an IMAGE_ALIGN boundary, inside the image, in order
    ends = [0] + [e.offset + e.nbytes for e in layout.entries]
    assert all(e.offset % 256 == 0 and e.offset >= end for e, end in zip(layout.entries, ends))
    assert ends[-1] <= layout.nbytes
    assert cpu_image.CpuLayerLayout.from_json(layout.to_json()) == layout


def _block(cfg, layer, rows: int) -> torch.Tensor:
    rope = RopeTable(cfg, 64, CPU)
    k = torch.zeros(cfg.n_kv_heads, 64, cfg.head_dim)
    v = torch.zeros_like(k)
    x = torch.randn(rows, cfg.hidden, generator=torch.Generator().manual_seed(rows))
    out = []
    for start in (0, rows):  # the second pass attends to the first one's cache entries
        step = append_step(start, rows, CPU)
        out.append(block_forward(cfg, layer, x + start, rope.angles(step.positions), step, k, v,
                                 rope))
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_views_of_the_image_compute_the_resident_layers_bits(model, rows):
    """Decode passes, and prefill passes (13 rows) where the layer prefills from its image
    (packed prefill: every linear q4vnni, q8vnni, q6vnni or held dense)."""
    case, gf, cfg = model
    host, layout = cpu_image.cpu_image_of(gf, cfg, FAST, 1)
    # Q4_K_M's q/k/v parts (INT4 q and k, Q6 v) prefill packed where both their layouts do
    kinds = [k if k != "parts" else ("parts" if {INT4, Q6} <= set(PREFILL_KINDS) else "other")
             for k in CASES[case].values()]
    takes = set(PREFILL_KINDS) | {"parts"}
    prefill_kinds = all(k in takes or k == "dense" for k in kinds) and \
        any(k in takes for k in kinds)
    assert cpu_image.prefills_from_image(layout) == prefill_kinds
    if rows > 8 and not prefill_kinds:
        pytest.skip("this layer's prefill is rebuilt from the GGUF file (tested in "
                    "tests/memory/test_cpu_stream_packed.py)")
    # at an odd page offset of a larger buffer, as a staging buffer holds it
    buf = torch.zeros(host.numel() + 3 * 4096, dtype=torch.uint8)
    buf[4096:4096 + host.numel()] = host
    views = cpu_image.decode_layer(layout, buf[4096:4096 + host.numel()])
    resident = LayerBuilder(cfg, CPU, FAST).build(TensorSource(gf), 1)
    assert torch.equal(_block(cfg, views, rows), _block(cfg, resident, rows))
    assert views.attn_q is None and views.ffn_gate is None  # the fused linears serve


@pytest.mark.slow
def test_the_image_is_pack_groups_copy_of_the_files_bytes(model):
    """Each packed plane in the image equals what weights.cpu.pack_group makes of the layer's
    GGUF bytes read straight from the file; dense ones equal the GGUF dequantizer's values."""
    case, gf, cfg = model
    host, layout = cpu_image.cpu_image_of(gf, cfg, FAST, 0)
    views = cpu_image.decode_layer(layout, host)
    shapes = spec_for(cfg.architecture).shapes(cfg)
    for group in spec_for(cfg.architecture).linears:
        field = group.field if len(group.parts) > 1 else group.parts[0]
        names = [f"blk.0.{p}" for p in group.parts]
        part_shapes = [shapes[f"{p}.weight"] for p in group.parts]
        raws = [raw_tensor(gf, f"{n}.weight", s) for n, s in zip(names, part_shapes)]
        types = [gf.tensors[f"{n}.weight"].ggml_type for n in names]
        got = getattr(views, field)
        if CASES[case][field] == "dense":
            assert isinstance(got, DenseLinear)
            want = torch.cat([torch.from_numpy(gguf.quants.dequantize(r.numpy(), t))
                              for r, t in zip(raws, types)]).to(torch.float16)
            assert torch.equal(got.weight, want)
            continue
        assert isinstance(got, PackedDecodeLinear)
        biases = [TensorSource(gf).dense(f"{n}.bias", (s[0],), torch.float32, CPU)
                  if f"{n}.bias" in gf.tensors else None for n, s in zip(names, part_shapes)]
        ref, refs = pack_group(raws, types, part_shapes, biases)
        if CASES[case][field] == "parts":  # each part as pack_group makes it alone
            assert ref is None and len(got.packed.parts) == len(refs)
            for packed, ref in zip(got.packed.parts, refs):
                _same_planes(packed, ref, field)
            continue
        # (an image names cb4's MXFP4 grid "cb4-mx", iq's format "iq-IQ3_XXS")
        assert ref.kind == CASES[case][field].split("-")[0] == kind_for(types[0])
        _same_planes(got.packed, ref, field)


def _same_planes(packed, ref, field: str) -> None:
    """packed's planes and bias are ref's (pack_group's of the file's bytes)."""
    if ref.kind == "cb4":
        assert packed.grid == ref.grid
    planes = {"int8pack": ("codes", "scales"), "q4vnni": ("packed",),
              "q8vnni": ("packed",), "q6vnni": ("packed",), "cb4": ("packed",),
              "iq": ("packed",)}.get(
        ref.kind, ("packed", "scale_zeros"))
    for plane in planes:
        assert torch.equal(getattr(packed, plane), getattr(ref, plane)), (field, plane)
    assert (packed.bias is None) == (ref.bias is None)
    if ref.bias is not None:
        assert torch.equal(packed.bias, ref.bias)


@pytest.mark.slow
def test_a_packed_linear_of_the_image_matches_gguf_dequantize(model):
    """The image's ffn_down against x @ W^T with W from gguf.quants.dequantize (float64): the
    packed layouts round scales and activations to bfloat16 (tests/weights/test_cpu_packed.py
    bounds each layout's error; here a relative 3e-2 of the output's scale)."""
    _, gf, cfg = model
    host, layout = cpu_image.cpu_image_of(gf, cfg, FAST, 0)
    down = cpu_image.decode_layer(layout, host).ffn_down
    name = "blk.0.ffn_down.weight"
    w = torch.from_numpy(gguf.quants.dequantize(
        raw_tensor(gf, name, (cfg.hidden, cfg.ffn)).numpy(), gf.tensors[name].ggml_type)).double()
    x = torch.randn(3, cfg.ffn)
    want = x.double() @ w.t()
    got = down(x).double()
    assert (got - want).abs().max() <= 3e-2 * want.abs().max()


@pytest.mark.slow
def test_a_decode_only_linear_refuses_a_prefill_pass(model, monkeypatch):
    """Without packed prefill (SLIPSTREAM_PACKED_PREFILL=0) an image's packed linear serves
    decode passes only: the store rebuilds prefill layers from the GGUF file."""
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", "0")
    _, gf, cfg = model
    host, layout = cpu_image.cpu_image_of(gf, cfg, FAST, 0)
    down = cpu_image.decode_layer(layout, host).ffn_down
    if isinstance(down, DenseLinear):
        pytest.skip("a dense linear serves every pass")
    with pytest.raises(RuntimeError, match="decode-only layer .* called with 9 rows"):
        down(torch.zeros(9, cfg.ffn))


def test_images_need_packed_decode(model):
    _, gf, cfg = model
    with pytest.raises(ValueError, match="packed decode copies"):
        cpu_image.cpu_image_of(gf, cfg, Precision.of("exact", CPU), 0)


def test_the_layout_fingerprint_is_this_machines_packing(monkeypatch):
    a = cpu_image.layout_fingerprint()
    assert a == cpu_image.layout_fingerprint() and isinstance(a, int)
    # the 4-bit formats as q4vnni or as int4pack (SLIPSTREAM_Q4VNNI=0) are other layouts: an
    # image of one must not serve a process that packs the other
    on = q4vnni_available()
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", "0")
    assert (cpu_image.layout_fingerprint() != a) == on
