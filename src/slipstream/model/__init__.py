"""The transformer math: pure functions over activations and weight objects.

Nothing here knows a weight's format (Q4_K, F16, ...) or where it lives (VRAM, pinned RAM, disk):
linear layers arrive as callables, norms as tensors. A `Step` says which positions, cache slots
and attention mask a forward step's tokens have.
"""

from .llama import (LayerWeights, block_forward, fused_decode_serves, rms_norm,
                    uses_fused_decode)
from .rope import RopeTable
from .step import Step, append_step, device_decode_step, fold_rows, tree_step

__all__ = ["LayerWeights", "RopeTable", "Step", "append_step", "block_forward",
           "device_decode_step", "fold_rows", "fused_decode_serves", "rms_norm", "tree_step", "uses_fused_decode"]
