"""CPU linear layers that compute on quantized weights, packed once at load time.

The CPU engine keeps dense float16/float32 weights for prefill (DenseLinear) and, for decode, a
packed copy of each matrix in one of these layouts (`kind_for` picks; `pack_linear` and
`pack_group` build; `packed_nbytes` sizes one before it is built):

    kind       module          formats          bits a weight read   kernel
    q4vnni     vnni            Q4_0 Q4_1 Q4_K   5 (Q4_K 4.625)        native/q4_matvec.c
    q8vnni     vnni            Q8_0             8.5                  native/q4_matvec.c
    q6vnni     q6vnni          Q6_K             6.625                native/q6_matvec.c
    cb4        codebook        MXFP4 IQ4_NL     5                    native/cb4_matvec.c
                               IQ4_XS
    iq         iquant          IQ3_XXS IQ2_XXS  the file's, 1.56     native/iq_matvec.c
                               IQ3_S IQ1_S      to 3.44
                               IQ2_XS IQ2_S
                               IQ1_M
    int4pack   torch_kernels   Q4_0 Q4_1 Q4_K   5                    torch's int4 CPU kernel
    int4pair   torch_kernels   Q8_0             10                   torch's int4 CPU kernel
    int8pack   torch_kernels   Q6_K (any)       8 + 2 bytes a row     torch's int8 CPU kernel

Where the native library builds, the 4-bit formats take q4vnni and Q8_0 q8vnni (exact weights,
16-bit activations); elsewhere, or with SLIPSTREAM_Q4VNNI=0, torch's kernels (bfloat16 scales
and activations). Q6_K takes q6vnni where the library has its AVX-512 VNNI loop (exact weights,
16-bit activations), else int8pack. The codebook formats (MXFP4, IQ4_NL, IQ4_XS) take cb4
wherever the native library builds, and so do the i-quant grid formats iq reads. A format no
layout reads stays dense.

All of them answer the Linear protocol (x (m, in) -> (m, out), `residual=`, `out_features`) for
any m; torch's packed kernels are meant for decode (m <= 8) and small speculation trees, the
native ones (PREFILL_KINDS) serve a prefill too. PackedDecodeLinear (decode) holds a packed
copy beside the dense weight and routes each call.
Each packed copy (iq's too, though it keeps the GGUF bytes as they are) costs RAM beside any
GGUF copy of the same rows; `nbytes` (or `packed_nbytes` before building) says how much.

Modules: groups (GGUF blocks as codes and per-group scales, bf16 rounding, shared load-time
helpers), native_pack (the load-time packers in C), torch_kernels, vnni, q6vnni, codebook and
iquant (the layouts), decode (PackedDecodeLinear), kinds (the choice and the builders).
"""

from .decode import PackedDecodeLinear, rms_norm_bf16
from .kinds import (AUTO_KINDS, KINDS, PREFILL_KINDS, kind_for, pack_group, pack_linear,
                    packed_nbytes, packed_prefill_on, prefills_packed)
from .vnni import Q4VnniLinear

__all__ = ["AUTO_KINDS", "KINDS", "PREFILL_KINDS", "PackedDecodeLinear", "Q4VnniLinear",
           "kind_for", "pack_group", "pack_linear", "packed_nbytes", "packed_prefill_on",
           "prefills_packed", "rms_norm_bf16"]
