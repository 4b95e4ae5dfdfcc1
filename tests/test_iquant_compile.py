"""The i-quant grid kernels (kernels/gemv_iq.py) compiled by Triton's real compiler for an
H100/H200 (sm_90) down to a cubin, with no GPU present: the interpreter runs them in Python
(tests/gpu/test_iquant_kernels.py checks their values there), which accepts code the
compiler may refuse. Needs Triton with its NVIDIA backend (ptxas ships in the wheel)."""

from __future__ import annotations

import os

import pytest
from gguf import GGMLQuantizationType as T

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1 replaces the kernels by Python")

# IQ3_XXS is the fast tier's (1 to 2 s a format here)
FORMATS = [pytest.param(t, marks=() if t == T.IQ3_XXS else pytest.mark.slow)
           for t in (T.IQ3_XXS, T.IQ2_XXS, T.IQ3_S, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)]
# the planes' element types (kernels/pack_iq.py); x bfloat16, y float32
_PTRS = {"x_ptr": "*bf16", "lo_ptr": "*u8", "hi_ptr": "*i32", "d_ptr": "*fp16",
         "sc_ptr": "*u8", "mn_ptr": "*u8", "cb_ptr": "*i64", "y_ptr": "*fp32",
         "ids_ptr": "*i32", "out_ptr": "*bf16"}


def _compile(kernel, qt: T, consts: dict[str, object]):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else _PTRS.get(n, "i32") for n in names}
    if qt == T.IQ2_XS:
        sig["lo_ptr"] = "*i16"
    if qt in (T.IQ1_S, T.IQ1_M):
        sig["sc_ptr"] = "*i16"
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.parametrize("qt", FORMATS, ids=lambda t: t.name)
def test_grid_kernels_compile_for_sm90(qt: T) -> None:
    from slipstream.kernels import gemv_iq

    launches = [(gemv_iq._gemv_iq_kernel, dict(M_PAD=1, BN=4, BK=256, ROUTED=False)),
                (gemv_iq._gemv_iq_kernel, dict(M_PAD=1, BN=4, BK=256, ROUTED=True)),
                (gemv_iq._gemv_iq_kernel, dict(M_PAD=8, BN=4, BK=256, ROUTED=False)),
                (gemv_iq._dequant_iq_kernel, dict(BN=8, BK=256))]
    for kernel, consts in launches:
        compiled = _compile(kernel, qt, dict(consts, FMT=int(qt)))
        assert len(compiled.asm["cubin"]) > 0, (qt.name, consts)
        assert ".target sm_90" in compiled.asm["ptx"]
