"""The type a weight takes when its rows are not a whole number of the asked type's blocks,
as llama.cpp's quantizer chooses it (llama-quant.cpp, tensor_type_fallback): real files carry
such weights (GLM-4.5-Air's experts are 1408 wide and its dense FFN 10944, neither a multiple
of a K-quant's 256), so the files slipstream writes do too."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

_FALLBACK: dict[Q, Q] = {
    **{t: Q.IQ4_NL for t in (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS,
                             Q.IQ3_S, Q.IQ4_XS)},
    Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def fitting_type(qtype: Q, cols: int) -> Q:
    """`qtype`, or llama.cpp's fallback where `cols` is not a whole number of its blocks (F16
    where the fallback's blocks do not fit either)."""
    if qtype in (Q.F32, Q.F16, Q.BF16) or cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = _FALLBACK.get(qtype, qtype)
    return fallback if cols % GGML_QUANT_SIZES[fallback][0] == 0 else Q.F16
