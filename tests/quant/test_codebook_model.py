"""Tiny models whose matrices are MXFP4, IQ4_NL or IQ4_XS, run at precision="exact" on the CPU,
against llama.cpp (llama-cpp-python) on the same file.

Two comparisons, as in tests/model/test_vs_llamacpp.py. On the file itself llama.cpp quantizes
the activations to 8 bits for these matmuls (vec_dot_iq4_nl_q8_0, vec_dot_mxfp4_q8_0, ...),
which moves the logits by percents, so only a loose tolerance holds. The tight one is against
llama.cpp on a float32 copy whose weights gguf-py's numpy dequantizer decoded (not ours), so
the two references are both written elsewhere: a wrong grid, nibble order or scale in our
decoder shows up there, and the negative controls check that it does.
"""

from __future__ import annotations

from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch

from helpers import cpu_engine
from llamacpp_ref import decisive, llamacpp_logits, rel_err
from slipstream.quant import codebook
from slipstream.quant import requantize as requantize_module
from slipstream.synth import write_synth

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it is in the "
                    "`test` extra: pip install -e '.[test]')")

IDS = list(range(7, 300, 11))  # 27 tokens, past the tiny shape's 16-position window
N_LAYERS = 2
TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4"]

# llama.cpp on the quantized file (8-bit activations), measured with llama-cpp-python 0.3.36
# on these 2-layer files: IQ4_NL 3.7e-2, IQ4_XS 5.4e-2, MXFP4 3.5e-2 (6 layers: 8.0e-2,
# 1.1e-1, 8.4e-2); the quantized-file tolerance test_vs_llamacpp.py holds Q8_0 files to
QUANT_REL_TOL = 0.2
# on the float32 copy: summation order only, 2.0e-6 to 2.3e-6 measured (the Q8_0 files' bound)
F32_REL_TOL = 1e-3
F32_DECISIVE_GAP = 5e-3


def _gguf_dequantize(raw: torch.Tensor, qtype, shape) -> torch.Tensor:
    out = gguf.quants.dequantize(raw.numpy().reshape(-1), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """type -> (its synthetic file, a float32 copy decoded by gguf-py), made on first use."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(qtype: str, arch: str = "llama") -> tuple[Path, Path]:
        if (qtype, arch) not in made:
            d = tmp_path_factory.mktemp(f"{qtype}-{arch}")
            q = write_synth(d / f"{qtype}.gguf", "tiny", qtype, std=0.15, seed=3,
                            n_layers=N_LAYERS, arch=arch)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(requantize_module, "dequantize", _gguf_dequantize)
                f32 = requantize_module.requantize(q, d / f"{qtype}-f32.gguf", "F32")
            made[qtype, arch] = (q, f32)
        return made[qtype, arch]

    return get


def _tight(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    err = rel_err(ours, ref)
    assert err < F32_REL_TOL, f"relative error {err:.2e} against llama.cpp on the float32 copy"
    keep = decisive(ref, F32_DECISIVE_GAP)
    assert keep.float().mean() > 0.5, "too few decided positions for top-1 to mean anything"
    differ = (ours.argmax(-1) != ref.argmax(-1)) & keep
    assert not differ.any(), f"top-1 differs at decided positions {differ.nonzero().flatten()}"


@pytest.mark.parametrize("qtype", [pytest.param(t, marks=() if t == "IQ4_NL" else
                                                pytest.mark.slow) for t in TYPES])
def test_matches_llamacpp(files, qtype):
    q, f32 = files(qtype)
    ours = cpu_engine(q, precision="exact").forward(IDS, all_logits=True)
    _tight(ours, llamacpp_logits(f32, IDS))
    err = rel_err(ours, llamacpp_logits(q, IDS))
    assert err < QUANT_REL_TOL, f"relative error {err:.2e} against llama.cpp on the {qtype} file"


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["MXFP4", "IQ4_XS"])
def test_experts_match_llamacpp(files, qtype):
    """MXFP4 as gpt-oss ships it: in the 3-D expert tensors of a mixture of experts (Qwen3-MoE's
    layer), sliced per expert from the file's bytes. On the quantized file measured 9.7e-2
    (MXFP4) and 1.1e-1 (IQ4_XS): the routing turns small differences into other experts, as
    test_vs_llamacpp.py's 1.2e-1 for a Q8_0 file of this family."""
    q, f32 = files(qtype, "qwen3moe")
    ours = cpu_engine(q, precision="exact").forward(IDS, all_logits=True)
    _tight(ours, llamacpp_logits(f32, IDS))
    err = rel_err(ours, llamacpp_logits(q, IDS))
    assert err < QUANT_REL_TOL, f"relative error {err:.2e} against llama.cpp on the {qtype} file"


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES)
def test_slipstream_quantize_writes_what_llamacpp_reads(qtype, tmp_path):
    """`slipstream quantize`'s encoders (gguf-py's for MXFP4, quant.encode_codebook's for the
    IQ4 types) on a float16 model: llama.cpp reads the file as we do."""
    src = write_synth(tmp_path / "f16.gguf", "tiny", "F16", std=0.15, seed=4,
                      n_layers=N_LAYERS)
    q = requantize_module.requantize(src, tmp_path / f"{qtype}.gguf", qtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(requantize_module, "dequantize", _gguf_dequantize)
        f32 = requantize_module.requantize(q, tmp_path / f"{qtype}-f32.gguf", "F32")
    ours = cpu_engine(q, precision="exact").forward(IDS, all_logits=True)
    _tight(ours, llamacpp_logits(f32, IDS))
    err = rel_err(ours, llamacpp_logits(q, IDS))
    assert err < QUANT_REL_TOL, f"relative error {err:.2e} against llama.cpp on the {qtype} file"


# Deliberately wrong decoders: Q4_0's uniform grid in place of IQ4_NL's fitted one (close:
# it differs by at most 17 of 127), and MXFP4 with its sign bit ignored. Measured 0.85
# (IQ4_NL), 0.62 (IQ4_XS), 1.41 (MXFP4) on the float32 copy: 600 times its tolerance or more
WRONG = {"IQ4_NL": ("IQ4NL_VALUES", tuple(range(-128, 128, 16))),
         "IQ4_XS": ("IQ4NL_VALUES", tuple(range(-128, 128, 16))),
         "MXFP4": ("MXFP4_VALUES", codebook.MXFP4_VALUES[:8] * 2)}


@pytest.mark.parametrize("qtype", [pytest.param(t, marks=() if t == "IQ4_NL" else
                                                pytest.mark.slow) for t in TYPES])
def test_llamacpp_tells_a_wrong_grid_apart(files, qtype, monkeypatch):
    q, f32 = files(qtype)
    name, values = WRONG[qtype]
    monkeypatch.setattr(codebook, name, values)
    wrong = cpu_engine(q, precision="exact").forward(IDS, all_logits=True)
    assert rel_err(wrong, llamacpp_logits(f32, IDS)) > 30 * F32_REL_TOL
