"""The transformer math: pure functions over activations and weight objects.

Nothing here knows a weight's format (Q4_K, F16, ...) or where it lives (VRAM, pinned RAM, disk):
linear layers arrive as callables, norms as tensors.
"""

from .llama import LayerWeights, Step, block_forward, causal_mask, rms_norm
from .rope import RopeTable

__all__ = ["LayerWeights", "RopeTable", "Step", "block_forward", "causal_mask", "rms_norm"]
