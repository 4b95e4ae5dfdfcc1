"""A linear group whose parts take different packed layouts (Q4_K_M's q/k/v: Q4_K q and k, Q6_K
v) decodes through its packed parts (weights.cpu.parts.PartsLinear), not its dense weight.

References: gguf.quants.dequantize (float64) for the product, each part packed alone
(weights.cpu.pack_linear) for the bits, and the resident layer for a streamed layer's image."""

from __future__ import annotations

import gguf.quants
import pytest
import torch

from slipstream.model.families import spec_for
from slipstream.model.llama import block_forward
from slipstream.model.rope import RopeTable
from slipstream.model.step import append_step
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights import cpu_image
from slipstream.weights.cpu import PackedDecodeLinear, kind_for, pack_linear
from slipstream.weights.cpu.parts import PartsLinear
from slipstream.weights.loader import LayerBuilder, TensorSource, raw_tensor

CPU = torch.device("cpu")
FAST = Precision.of("fast", CPU)


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    path = write_synth(tmp_path_factory.mktemp("parts") / "m.gguf", "tiny", "Q4_K_M",
                       n_layers=2, from_floats=True, std=0.08, seed=11)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    yield gf, cfg
    gf.close()


def _qkv(gf, cfg, layer: int):
    shapes = spec_for(cfg.architecture).shapes(cfg)
    names = [f"blk.{layer}.attn_{p}.weight" for p in "qkv"]
    part_shapes = [shapes[f"attn_{p}.weight"] for p in "qkv"]
    raws = [raw_tensor(gf, n, s) for n, s in zip(names, part_shapes)]
    types = [gf.tensors[n].ggml_type for n in names]
    return raws, types, part_shapes


def test_mixed_qkv_decodes_through_its_packed_parts(q4km):
    gf, cfg = q4km
    raws, types, shapes = _qkv(gf, cfg, 0)
    assert len({kind_for(t) for t in types}) == 2  # the file mixes two layouts
    layer = LayerBuilder(cfg, CPU, FAST).build(TensorSource(gf), 0)
    lin = layer.attn_qkv
    assert isinstance(lin, PackedDecodeLinear) and isinstance(lin.packed, PartsLinear)
    assert [p.kind for p in lin.packed.parts] == [kind_for(t) for t in types]
    x = torch.randn(1, cfg.hidden, generator=torch.Generator().manual_seed(2))
    got = lin(x)
    # each part's columns are that part packed alone, bit for bit
    singles = [pack_linear(r, t, s) for r, t, s in zip(raws, types, shapes)]
    assert torch.equal(got, torch.cat([p.kernel(x.to(torch.bfloat16)) for p in singles],
                                      dim=1).float())
    # and the product is the file's weights' (float64 oracle; 16-bit activations and outputs)
    w = torch.cat([torch.from_numpy(gguf.quants.dequantize(r.numpy(), t)).double()
                   for r, t in zip(raws, types)])
    want = x.double() @ w.t()
    assert (got.double() - want).abs().max() <= 3e-2 * want.abs().max()
    # negative control: v's rows taken from k's part miss the oracle
    swapped = torch.cat([got[:, :-shapes[2][0]], got[:, -2 * shapes[2][0]:-shapes[2][0]]], 1)
    assert (swapped.double() - want).abs().max() > 3e-2 * want.abs().max()


def test_a_streamed_image_of_the_parts_gives_the_resident_bits(q4km):
    gf, cfg = q4km
    host, layout = cpu_image.cpu_image_of(gf, cfg, FAST, 1)
    kind = layout.linears["attn_qkv"][0]
    _, types, shapes = _qkv(gf, cfg, 1)
    assert kind == cpu_image.PARTS + ",".join(f"{kind_for(t)}/{s[0]}"
                                              for t, s in zip(types, shapes))
    assert host.numel() == layout.nbytes == cpu_image.image_nbytes(gf, cfg, 1, FAST)
    assert cpu_image.CpuLayerLayout.from_json(layout.to_json()) == layout
    buf = torch.zeros(host.numel() + 4096, dtype=torch.uint8)
    buf[4096:] = host  # at a page offset of a larger buffer, as a staging buffer holds it
    views = cpu_image.decode_layer(layout, buf[4096:])
    assert isinstance(views.attn_qkv.packed, PartsLinear)
    resident = LayerBuilder(cfg, CPU, FAST).build(TensorSource(gf), 1)
    rope = RopeTable(cfg, 64, CPU)
    x = torch.randn(1, cfg.hidden, generator=torch.Generator().manual_seed(5))
    outs = []
    for layer in (views, resident):
        k = torch.zeros(cfg.n_kv_heads, 64, cfg.head_dim)
        v = torch.zeros_like(k)
        step = append_step(0, 1, CPU)
        outs.append(block_forward(cfg, layer, x, rope.angles(step.positions), step, k, v,
                                  rope))
    assert torch.equal(outs[0], outs[1])
