"""Triton GPU kernels: fused dequant-GEMV over GGUF formats, dequant for prefill, RMSNorm.

Importing this package never needs CUDA or Triton (CI is CPU-only): the kernel modules are
imported on first use of a name below. `available()` says whether they can run here.

    packed = pack_weight(raw_uint8_cuda, qtype, rows, cols)   # once, at load time
    y = matmul(x, packed)        # m <= 8: fused GEMV; m <= 128: qgemm; larger: dequant + cuBLAS
    y = gemv(x, packed)          # x (m <= 8, K)
    y = gemv_routed(x, stacked, ids, n_experts, x_div)  # each (token, slot)'s expert, by ids
    y = qgemm(x, packed)         # x (m <= 128, K), quantized W, on the tensor cores
    y = qgemm(x, packed, exact=True)  # the same in float32 values and sums (precision "exact")
    w = dequantize(packed)       # (N, K) bf16
    y = rms_norm(x, w, eps) ; y, h = rms_norm(x, w, eps, residual=r)
"""

from __future__ import annotations

import importlib
import os
from typing import Any

_EXPORTS = {
    "PackedWeight": "pack", "pack_weight": "pack", "QSPECS": "pack", "SUPPORTED": "pack",
    "gemv": "gemv", "gemv_config": "gemv", "MAX_M": "gemv", "gemv_routed": "gemv",
    "dequantize": "dequant", "matmul": "dequant", "QGEMM_MAX_M": "dequant",
    "QGEMM_MIN_M": "dequant", "qgemm_supports": "dequant",
    "qgemm": "qgemm",
    "rms_norm": "norm",
    "decode_attention": "attention",
    "rope_and_cache": "rope",
    "wait_host_flag": "host_wait", "wait_host_add": "host_wait", "send_to_host": "host_wait",
    "gather_host_rows": "host_rows",
}
# kernels.gemv_q8 is the module (int8-activation GEMV: quantize_x, rms_norm_q8, gemv_q8,
# gemv_q8_quantized); it is imported on first attribute access like the others.

__all__ = sorted(_EXPORTS) + ["available"]


def available() -> bool:
    """True when Triton imports and a CUDA device is present (or TRITON_INTERPRET=1 is set)."""
    try:  # local: this package imports without torch or Triton (see above)
        import torch
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slipstream.kernels' has no attribute {name!r}")
    # Import every kernel module, then bind all exports: importing submodule `gemv` sets the
    # package attribute `gemv` to the module, which must not shadow the function of that name.
    mods = {m: importlib.import_module(f".{m}", __name__) for m in sorted(set(_EXPORTS.values()))}
    for export, m in _EXPORTS.items():
        globals()[export] = getattr(mods[m], export)
    return globals()[name]
