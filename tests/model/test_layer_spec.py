"""model.layer_spec against real files: the tensors it lists are the ones synthesized files
hold (their index read by the gguf package, not by slipstream), the linears it says fuse are
the ones LayerBuilder builds, and its KV cache size is the cache's."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from slipstream.errors import UnsupportedArchitecture
from slipstream.model.families import ARCHITECTURES, spec_for
from slipstream.model.layer_spec import EMBEDDING, HEAD, head_tensor_name, kv_cache_bytes
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth

CPU = torch.device("cpu")
CASES = [(arch, tied) for arch in ("llama", "qwen2") for tied in (False, True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'head'}")
def model(request, tmp_path_factory):
    """A Q4_K_M file: attn_v and ffn_down in Q6_K next to Q4_K, so q/k/v differ in type."""
    arch, tied = request.param
    path = write_synth(tmp_path_factory.mktemp("spec") / f"{arch}.gguf", "tiny", "Q4_K_M",
                       arch=arch, tie_embeddings=tied)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    return path, gf, cfg, tied


def _index(path) -> dict[str, tuple[tuple[int, ...], object]]:
    """name -> (torch-order shape, GGML type), as the gguf package reads the file."""
    return {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type)
            for t in GGUFReader(path).tensors}


def test_spec_lists_the_tensors_the_file_holds(model):
    path, gf, cfg, tied = model
    index = _index(path)
    spec = spec_for(cfg.architecture)
    shapes = spec.shapes(cfg)
    assert any(s.endswith(".bias") for s in shapes) == (cfg.architecture == "qwen2")
    for i in range(cfg.n_layers):
        held = {n: v[0] for n, v in index.items() if n.startswith(f"blk.{i}.")}
        assert held == {f"blk.{i}.{s}": shape for s, shape in shapes.items()}
        assert sorted(spec.names(i, index)) == sorted(held)
    rest = {n for n in index if not n.startswith("blk.")}
    assert rest == {EMBEDDING, "output_norm.weight"} | (set() if tied else {HEAD})
    assert head_tensor_name(index) == (EMBEDDING if tied else HEAD)


def test_fused_groups_are_the_ones_the_builder_makes(model):
    """On CPU every group fuses (dense weights share the weight dtype); the quantized rule,
    from the file's own types, keeps q/k/v apart in this mix and fuses gate/up."""
    from slipstream.weights.loader import LayerBuilder, TensorSource

    path, gf, cfg, _ = model
    index = _index(path)
    spec = spec_for(cfg.architecture)

    def types(i, group):
        return [index[f"blk.{i}.{p}.weight"][1] for p in group.parts]

    builder = LayerBuilder(cfg, CPU, Precision.of("fast", CPU))
    for i in range(cfg.n_layers):
        layer = builder.build(TensorSource(gf), i)
        for group in spec.linears:
            assert all(getattr(layer, p) is not None for p in group.parts)
            if len(group.parts) > 1:
                assert group.fuses(types(i, group), dense=True)
                assert getattr(layer, group.field) is not None, group.field
    fuses = {g.field: g.fuses(types(0, g)) for g in spec.linears}
    assert fuses == {"attn_qkv": False, "ffn_gate_up": True, "attn_output": False,
                     "ffn_down": False}


def test_quantized_builder_fuses_as_the_spec_says(model):
    """The CUDA path's rule, on a builder that packs for the kernels on the CPU (QuantLinear
    only looks the Triton kernels up; it never runs them here)."""
    pytest.importorskip("triton")
    from slipstream.memory.vram import _linears
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder, TensorSource

    path, gf, cfg, _ = model
    index = _index(path)
    spec = spec_for(cfg.architecture)
    builder = LayerBuilder(cfg, CPU, Precision.of("fast", CPU), workspace=Workspace(CPU))
    builder.quantized = True
    layer = builder.build(TensorSource(gf), 0)
    n_linears = 0
    for group in spec.linears:
        if group.fuses([index[f"blk.0.{p}.weight"][1] for p in group.parts]):
            assert getattr(layer, group.field) is not None, group.field
            assert all(getattr(layer, p) is None for p in group.parts)
            n_linears += 1
        else:
            assert all(getattr(layer, p) is not None for p in group.parts)
            if len(group.parts) > 1:
                assert getattr(layer, group.field) is None, group.field
            n_linears += len(group.parts)
    assert len(_linears(gf, cfg, 0)) == n_linears  # memory.vram sizes the same linears


def test_kv_cache_bytes_is_the_caches_size(model):
    from slipstream.runtime.kv_cache import KVCache

    _, _, cfg, _ = model
    for dtype in (torch.float32, torch.float16):
        cache = KVCache(cfg, 48, CPU, dtype)
        assert cache.nbytes == kv_cache_bytes(cfg, cfg.n_layers, 48, dtype.itemsize)


def test_every_architecture_has_a_layer():
    for arch in ARCHITECTURES:
        assert spec_for(arch).linears
    with pytest.raises(UnsupportedArchitecture, match="'mamba' is not supported"):
        spec_for("mamba")
