"""The metadata and tensors each family reads beyond the Llama block's, checked without a
forward pass (the fast tier): what files it turns away, naming the key or tensor, and the
docs' table of families against the families the code has."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch

from helpers import patch
from slipstream.errors import GGUFError, InvalidMetadata, MissingMetadata, UnsupportedArchitecture
from slipstream.model.families import ARCHITECTURES
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.loader import load_weights

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
CPU = torch.device("cpu")


def metadata(tmp_path: Path, arch: str) -> tuple[dict, set[str]]:
    gf = GGUFFile(write_synth(tmp_path / f"{arch}.gguf", "tiny", "Q8_0", n_layers=1, arch=arch))
    return dict(gf.metadata), set(gf.tensors)


def test_docs_list_every_architecture():
    table = DOCS.read_text()
    for arch in ARCHITECTURES:
        assert f"`{arch}`" in table, arch


def test_olmo_with_a_sliding_window_is_turned_away(tmp_path):
    md, names = metadata(tmp_path, "olmo2")
    ModelConfig.from_metadata(md, names)
    md["olmo2.attention.sliding_window"] = 4096  # OLMo 3's reading of the architecture
    with pytest.raises(UnsupportedArchitecture, match="sliding_window is 4096"):
        ModelConfig.from_metadata(md, names)


def test_multimodal_glm4_is_turned_away(tmp_path):
    md, names = metadata(tmp_path, "glm4")
    assert ModelConfig.from_metadata(md, names).attn_bias  # GLM-4's QKV biases
    md["glm4.rope.dimension_sections"] = [8, 12, 12, 0]
    with pytest.raises(UnsupportedArchitecture, match=r"dimension_sections is \[8, 12, 12, 0\]"):
        ModelConfig.from_metadata(md, names)


def test_cohere2_reads_its_norm_window_and_logit_scale(tmp_path):
    md, names = metadata(tmp_path, "cohere2")
    cfg = ModelConfig.from_metadata(md, names)
    assert (cfg.norm, cfg.parallel, cfg.global_rope) == ("layer", True, False)
    assert (cfg.sliding_window, cfg.swa_pattern, cfg.logit_scale) == (16, 4, 0.25)
    assert [cfg.window_of(i) for i in range(8)] == [16, 16, 16, 0] * 2
    assert "output.weight" not in names  # the head is the embedding
    md["cohere2.logit_scale"] = -1.0
    with pytest.raises(InvalidMetadata, match="cohere2.logit_scale"):
        ModelConfig.from_metadata(md, names)
    del md["cohere2.attention.sliding_window"]
    with pytest.raises(MissingMetadata, match="cohere2.attention.sliding_window"):
        ModelConfig.from_metadata(md, names)


def test_mistral3_temperature_only_where_the_file_has_one(tmp_path):
    md, names = metadata(tmp_path, "mistral3")
    cfg = ModelConfig.from_metadata(md, names)
    assert cfg.attn_temp_scale == pytest.approx(0.1)  # (a float32 in the file)
    assert (cfg.attn_temp_floor, cfg.rope_style) == (16, "normal")
    del md["mistral3.attention.temperature_scale"]  # Mistral Small 3.x
    cfg = ModelConfig.from_metadata(md, names)
    assert cfg.attn_temp_scale == 0.0


def test_yarn_reads_as_llama_cpp_does(tmp_path):
    """Ministral 3's YaRN: factor 16 over the original context, ramp bounds 32 and 1, and
    the factor on cos and sin, which its yarn_log_multiplier of 1 cancels; without the
    multiplier, 1 + 0.1 ln(16) (llama.cpp's get_mscale)."""
    md, names = metadata(tmp_path, "mistral3")
    cfg = ModelConfig.from_metadata(md, names)
    assert (cfg.rope_scaling, cfg.rope_scale, cfg.rope_ctx_orig) == ("yarn", 16.0, 16)
    assert (cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.rope_attn_factor) == (32.0, 1.0, 1.0)
    del md["mistral3.rope.scaling.yarn_log_multiplier"]
    assert ModelConfig.from_metadata(md, names).rope_attn_factor == pytest.approx(
        1 + 0.1 * math.log(16))
    md["mistral3.rope.scaling.type"] = "dynamic"
    with pytest.raises(UnsupportedArchitecture, match="'dynamic'"):
        ModelConfig.from_metadata(md, names)


def test_phi3_divisors_must_be_positive(tmp_path):
    path = write_synth(tmp_path / "phi3.gguf", "tiny", "Q8_0", n_layers=1, arch="phi3")
    gf = GGUFFile(path)
    offset = gf.tensors["rope_factors_long.weight"].offset + 3 * 4
    gf.close()
    patch(path, offset, struct.pack("<f", -2.0))
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    with pytest.raises(InvalidMetadata, match=r"'rope_factors_long.weight' has value -2.0 at "
                                              r"index 3"):
        load_weights(gf, cfg, CPU, Precision.of("exact", CPU))


def test_phi3_without_its_fused_qkv_names_the_tensor(tmp_path):
    md, names = metadata(tmp_path, "phi3")
    with pytest.raises(GGUFError, match="blk.0.attn_qkv.weight"):
        ModelConfig.from_metadata(md, names - {"blk.0.attn_qkv.weight"})


@pytest.mark.parametrize("arch", ["phi3", "mistral3", "olmo2", "glm4", "cohere2"])
def test_synth_cli_writes_each_family(arch, tmp_path):
    """`slipstream synth --arch FAMILY` (the command's own parser and run, in process)."""
    from slipstream.cli import main

    out = tmp_path / f"{arch}.gguf"
    assert main(["synth", "--shape", "tiny", "--layers", "1", "--quant", "Q4_0", "--arch", arch,
                 "-o", str(out)]) == 0
    gf = GGUFFile(out)
    assert ModelConfig.from_metadata(gf.metadata, set(gf.tensors)).architecture == arch
