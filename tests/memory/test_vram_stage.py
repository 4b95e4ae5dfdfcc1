"""memory.vram.vram_reserve for one stage of a model split over devices: the KV cache of the
stage's layers only, and the embedding and head only where the stage holds them."""

from __future__ import annotations

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory.vram import vram_reserve
from slipstream.model.layer_spec import kv_cache_bytes
from slipstream.synth import write_synth


def test_stage_reserve(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K_M", n_layers=4)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    args = dict(ctx=512, kv_bytes_per_elem=2, chunk=2048, graphs=True, graph_bucket=256)
    whole = vram_reserve(gf, cfg, **args)
    assert whole == vram_reserve(gf, cfg, **args, kv_layers=4, holds_embedding=True,
                                 holds_head=True)
    assert whole["KV cache"] == kv_cache_bytes(cfg, 4, 512, 2)
    first = vram_reserve(gf, cfg, **args, kv_layers=1, holds_head=False)
    last = vram_reserve(gf, cfg, **args, kv_layers=3, holds_embedding=False)
    assert first["KV cache"] + last["KV cache"] == whole["KV cache"]
    assert first["head"] == 0 and last["head"] == whole["head"] > 0
    assert last["embedding"] == 0 and first["embedding"] == whole["embedding"] > 0
    # a stage without the head sizes its scratch by its layers' weights alone
    assert first["prefill workspace"] <= whole["prefill workspace"]
