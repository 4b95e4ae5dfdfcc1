"""slipstream synth's files as other GGUF readers see them."""

from __future__ import annotations

from collections import Counter

import gguf
import pytest

from slipstream.synth import QUANT_MIXES, write_synth


@pytest.mark.parametrize("mix", sorted(QUANT_MIXES))
def test_file_type_names_the_layers_format_in_llamacpps_enum(tmp_path, mix):
    """general.file_type is llama.cpp's LlamaFileType (it labels the model by it), not the
    GGML type id of the tensors: Q4_K's id read as a file type is "Q3_K - Medium"."""
    reader = gguf.GGUFReader(write_synth(tmp_path / f"{mix}.gguf", "tiny", mix))
    field = reader.fields["general.file_type"]
    file_type = gguf.LlamaFileType(int(field.parts[field.data[0]][0]))
    matrices = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors
                       if t.name.startswith("blk.") and len(t.shape) == 2)
    most_common = matrices.most_common(1)[0][0]
    assert file_type.name.startswith(f"MOSTLY_{most_common}"), (file_type, matrices)


def test_cli_offers_every_mix(tmp_path):
    """`slipstream synth --quant` lists its choices without importing synth (a fast --help):
    they must be QUANT_MIXES' names, and a grid i-quant one writes its file."""
    from slipstream.cli import build_parser, main

    synth = next(a for a in build_parser()._actions if a.dest == "command").choices["synth"]
    quant = next(a for a in synth._actions if a.dest == "quant")
    assert sorted(quant.choices) == sorted(QUANT_MIXES)
    out = tmp_path / "iq3s.gguf"
    assert main(["synth", "--shape", "tiny", "--quant", "IQ3_S", "--layers", "1",
                 "-o", str(out)]) == 0
    types = {gguf.GGMLQuantizationType(t.tensor_type).name
             for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.ffn_down.weight"}
    assert types == {"IQ3_S"}
