"""The transformer math: pure functions over activations and weight objects.

Nothing here knows a weight's format (Q4_K, F16, ...) or where it lives (VRAM, pinned RAM, disk):
linear layers arrive as callables, norms as tensors. A `Step` says which positions, cache slots
and attention mask a forward step's tokens have.

The names are imported on first use (PEP 562 module `__getattr__`): `model.layer_spec` is pure
data that `modelfile/config.py` reads to check a file's tensor names, and importing it must not
bring in torch (`slipstream info` and `--help` stay torch-free).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the submodule that defines it
_EXPORTS = {
    "LayerWeights": "llama", "block_forward": "llama", "fused_decode_serves": "llama",
    "rms_norm": "llama", "uses_fused_decode": "llama",
    "RopeTable": "rope",
    "Step": "step", "append_step": "step", "device_decode_step": "step", "fold_rows": "step",
    "tree_step": "step",
}

__all__ = ["LayerWeights", "RopeTable", "Step", "append_step", "block_forward",
           "device_decode_step", "fold_rows", "fused_decode_serves", "rms_norm", "tree_step",
           "uses_fused_decode"]

if TYPE_CHECKING:  # for type checkers and editors: the eager imports
    from .llama import (LayerWeights, block_forward, fused_decode_serves, rms_norm,
                        uses_fused_decode)
    from .rope import RopeTable
    from .step import Step, append_step, device_decode_step, fold_rows, tree_step


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
