"""The type a weight takes when its rows are not whole blocks of the asked type: slipstream's
rule (quant.fallback, used by `synth`) against llama.cpp's own quantizer (llama-cpp-python's
llama_model_quantize) on a file whose FFN is 352 wide, 11 blocks of 32 and no whole 256."""

from __future__ import annotations

import dataclasses
import ctypes

import gguf
import pytest

from slipstream.quant.fallback import fitting_type
from slipstream.synth import SHAPES, write_synth

Q = gguf.GGMLQuantizationType
llama_cpp = pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("ftype, target", [("Q4_K_S", Q.Q4_K), ("Q5_K_S", Q.Q5_K),
                                           ("Q6_K", Q.Q6_K)])
def test_fallback_is_llamacpps(tmp_path, ftype, target):
    shape = dataclasses.replace(SHAPES["tiny"], ffn=352, n_layers=1)
    src = write_synth(tmp_path / "f16.gguf", shape, "F16")
    dst = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                          ctypes.byref(params)) == 0
    types = {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(dst).tensors}
    down = types["blk.0.ffn_down.weight"]  # its rows are 352 wide
    assert down != target  # the file does need the fallback
    assert fitting_type(target, 352) == down
    assert fitting_type(target, 256 * 3) == target  # whole blocks keep the type
