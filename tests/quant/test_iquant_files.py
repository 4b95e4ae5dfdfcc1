"""Whole models in the i-quant grid formats: `slipstream synth` writes them (random codes, sane
scales), the CPU engine runs them at precision="exact" as llama.cpp (llama-cpp-python, CPU)
runs the same file, and the CUDA check before a load takes them (their GPU kernels:
tests/gpu/test_iquant_kernels.py).

llama.cpp's CPU matmuls on these formats quantize the activations to 8 bits (Q8_K blocks of
256), which is all that separates the two here: on 2-layer tiny llama files at weight std 0.02
the logits differ by 1.40e-2 to 1.57e-2 (relative norm) for all seven formats, and by 1.40e-2
for a Q4_K file of the same shape and seed, whose matmuls take the same Q8_K path. (At
test_vs_llamacpp.py's setting, 6 layers at std 0.15, IQ2_XXS and IQ3_S measured 0.111, inside
its 0.2 for quantized files.) A wrong reading of a format is far outside: ignoring IQ3_S's
ninth index bit measured 1.06, IQ2_XXS's sign patterns without their parity bit 1.13, IQ1_M's
shifts with the wrong sign 0.67.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers import cpu_engine
from llamacpp_ref import llamacpp_logits, rel_err
from slipstream.errors import UnsupportedTensorType
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.quant import base, iquants
from slipstream.runtime.build import check_types_device
from slipstream.synth import write_synth

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary
REL_TOL = 5e-2  # measured at most 1.57e-2; a wrong format at least 0.67 (module docstring)
MIN_TOP1 = 0.85  # measured 96% to 100% of the 27 positions

# IQ3_S is the fast tier's (0.7 s here, IQ2_XXS 1.2 s once the grids are built)
MIXES = [pytest.param(m, marks=() if m == "IQ3_S" else pytest.mark.slow)
         for m in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")]


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory):
    """mix -> its tiny 2-layer llama file (written on first use)."""
    made = {}

    def file(mix: str):
        if mix not in made:
            path = tmp_path_factory.mktemp(mix) / f"{mix}.gguf"
            made[mix] = write_synth(path, "tiny", mix, seed=3, std=0.02, n_layers=2)
        return made[mix]

    return file


def test_synth_writes_the_layer_matrices_in_the_format(grid_file) -> None:
    gf = GGUFFile(grid_file("IQ3_S"))
    layer = {n: t.ggml_type for n, t in gf.tensors.items()
             if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n}
    assert layer and set(layer.values()) == {T.IQ3_S}


@pytest.mark.parametrize("mix", MIXES)
def test_grid_file_matches_llamacpp(grid_file, mix: str) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = grid_file(mix)
    ref = llamacpp_logits(path, IDS)
    ours = cpu_engine(path, precision="exact").forward(IDS, all_logits=True)
    assert ours.shape == ref.shape
    err = rel_err(ours, ref)
    assert err < REL_TOL, f"relative error {err:.2e} against llama.cpp (tolerance {REL_TOL})"
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert top1 >= MIN_TOP1, f"top-1 agrees with llama.cpp at {top1:.0%} of positions"


# Mixtures of experts (the community's big i-quant files are): their 3-D expert tensors in the
# format too. Routing turns llama.cpp's activation rounding into other experts now and then:
# qwen3moe measured 1.42e-2 (IQ2_XXS) and 2.89e-2 (IQ3_S, top-1 at 85%), mixtral 1.39e-2
# (IQ2_XXS) and 1.21e-2 (IQ3_S); top-1 is not held here
MOE_REL_TOL = 0.1


@pytest.mark.slow
@pytest.mark.parametrize("arch, mix", [("qwen3moe", "IQ3_S"), ("mixtral", "IQ2_XXS")])
def test_grid_experts_match_llamacpp(tmp_path, arch: str, mix: str) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = write_synth(tmp_path / f"{arch}-{mix}.gguf", "tiny", mix, arch=arch, seed=3,
                       std=0.02, n_layers=2)
    experts = {t.ggml_type for n, t in GGUFFile(path).tensors.items() if "_exps." in n}
    assert experts == {T[mix]}
    ref = llamacpp_logits(path, IDS)
    ours = cpu_engine(path, precision="exact").forward(IDS, all_logits=True)
    err = rel_err(ours, ref)
    assert err < MOE_REL_TOL, f"relative error {err:.2e} against llama.cpp"


def _without_ninth_bit(blocks: torch.Tensor) -> torch.Tensor:
    # IQ3_S read with its qh bytes (the grid indices' ninth bits) taken as zero
    blocks = blocks.clone()
    blocks[:, 66:74] = 0
    return iquants._iq3_s(blocks)


def test_llamacpp_tells_a_wrong_format_apart(grid_file, monkeypatch) -> None:
    """Negative control: the same file through a wrong IQ3_S reader must fail the comparison
    by far, or agreeing with llama.cpp would prove little."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = grid_file("IQ3_S")
    ref = llamacpp_logits(path, IDS)
    monkeypatch.setitem(base.registry(), T.IQ3_S, base.QuantFormat(T.IQ3_S, _without_ninth_bit))
    wrong = cpu_engine(path, precision="exact").forward(IDS, all_logits=True)
    assert rel_err(wrong, ref) > 10 * REL_TOL


def test_cuda_takes_the_grid_formats(grid_file) -> None:
    """Checked before the plan, so this runs without a GPU: a torch.device names CUDA
    without touching it."""
    for mix in ("IQ2_XXS", "IQ1_M"):
        check_types_device(GGUFFile(grid_file(mix)), torch.device("cuda"))


def test_cuda_names_a_format_the_cpu_reads_but_no_kernel_does(grid_file, monkeypatch) -> None:
    """A format the CPU reads without a GPU kernel (IQ2_XXS taken out of the kernels' list)
    is named, with the way to run it."""
    from slipstream.kernels import pack

    gf = GGUFFile(grid_file("IQ2_XXS"))
    monkeypatch.setattr(pack, "SUPPORTED", tuple(t for t in pack.SUPPORTED if t != T.IQ2_XXS))
    with pytest.raises(UnsupportedTensorType, match=r"tensor type IQ2_XXS has no GPU kernel.*"
                                                    r"device='cpu'"):
        check_types_device(gf, torch.device("cuda"))
    check_types_device(gf, torch.device("cpu"))  # the CPU takes it


def test_cuda_check_passes_the_formats_it_has_kernels_for(tmp_path) -> None:
    path = write_synth(tmp_path / "q4k.gguf", "tiny", "Q4_K_M", n_layers=1)
    check_types_device(GGUFFile(path), torch.device("cuda"))


def test_cuda_check_does_not_send_to_the_cpu_what_it_cannot_read(tmp_path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(tmp_path / "i32.gguf", "llama")
    w.add_tensor("blk.0.ids.weight", np.arange(8, dtype=np.int32))  # I32: no format at all
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedTensorType, match=r"tensor type I32 is not supported$"):
        check_types_device(GGUFFile(tmp_path / "i32.gguf"), torch.device("cuda"))


def test_fast_precision_on_the_cpu(grid_file) -> None:
    """precision="fast" on the CPU: a 27-token pass is a prefill (more than GEMV_MAX_ROWS
    rows), whose weights are dequantized to float16 (IQ3_S decodes through iq:
    tests/weights/test_iquant_cpu.py); measured 3.8e-4 from "exact"."""
    path = grid_file("IQ3_S")
    exact = cpu_engine(path, precision="exact").forward(IDS, all_logits=True)
    fast = cpu_engine(path, precision="fast").forward(IDS, all_logits=True)
    assert rel_err(fast, exact) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("mix", [m.values[0] for m in MIXES])
def test_cuda_runs_it_as_the_cpu_does(grid_file, mix: str) -> None:
    """The whole model on CUDA at "exact" (the i-quant GEMVs and the prefill's dequantized
    weights) within the dense engine's bound of the CPU engine (tests/gpu/test_engine.py)."""
    import slipstream

    path = grid_file(mix)
    with slipstream.load(path, device="cuda", ctx=64, precision="exact") as gpu:
        got = gpu.engine.forward(IDS, all_logits=True).cpu()
        step = gpu.engine.decode(torch.tensor([7], device="cuda")).cpu()
    cpu = cpu_engine(path, precision="exact")
    want = cpu.forward(IDS, all_logits=True)
    assert rel_err(got, want) < 1e-2, mix
    assert rel_err(step, cpu.decode(torch.tensor([7]))) < 1e-2, mix
