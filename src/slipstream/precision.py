"""What precision="fast" or "exact" means on one device, decided once (api.load makes it) and
read as explicit fields everywhere else, rather than decoded again from a weight dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BadArgument

NAMES = ("fast", "exact")


@dataclass(frozen=True)
class Precision:
    name: str  # "fast" or "exact"
    # CPU dense weights: float16 (fast: half the bytes per decode token, see
    # weights.linear.DenseLinear) or float32 (exact). CUDA weights keep their GGUF formats.
    weight_dtype: torch.dtype
    # float32 on CPU; float16 on CUDA (more mantissa than bf16, and attention values never
    # approach its range)
    kv_dtype: torch.dtype
    act_dtype: torch.dtype  # the residual stream: float32 on both
    # CUDA fast: decode GEMVs round x to int8 per block of 32 (weights.linear.Workspace)
    int8_activations: bool
    # CUDA fast: resident layers fold each group's scale and min into one f16 plane
    # (kernels.pack.fuse_scales); streamed layers keep the GGUF layout whatever this says
    fuse_scales: bool
    # CPU fast: decode matvecs through packed int4/int8 copies of the weights (weights.
    # weights.cpu.PackedDecodeLinear: bfloat16 activations), prefill through the dense ones
    cpu_packed_decode: bool = False
    # CUDA exact: matmuls of more rows than the decode GEMV takes (tree passes, prefill) also
    # multiply float32 values, so that a verification pass rounds like the decode steps it
    # stands for up to summation order (float16 products there parted speculative greedy
    # from plain at top-2 margins of 2-3e-3 on an H200)
    float32_products: bool = False

    @classmethod
    def of(cls, name: str, device: torch.device, unscaled_attention: bool = False
           ) -> "Precision":
        """Precision `name` on `device` (cpu or cuda); BadArgument for any other name.

        unscaled_attention: the model's attention scale is 1 (Gemma 4: its query and key
        norms keep q.k in range). "exact" on CUDA then keeps the KV cache in float32: a
        float16 key's rounding moves a score by |q||k| times 5e-4, where 1/sqrt(head_dim)
        would have divided it by 8 to 16. On a tiny Gemma 4 file, a float16 cache alone moved
        the CPU engine's logits by up to 5.8e-2 (Gemma 3's: 1e-3), about what CUDA differed
        by; "fast" keeps float16, as llama.cpp does."""
        if name not in NAMES:
            raise BadArgument(f"precision={name!r} is invalid: use 'fast' or 'exact'")
        fast = name == "fast"
        cuda_fast = fast and device.type == "cuda"
        kv32 = device.type == "cpu" or (unscaled_attention and not fast)
        return cls(name=name, weight_dtype=torch.float16 if fast else torch.float32,
                   kv_dtype=torch.float32 if kv32 else torch.float16,
                   act_dtype=torch.float32, int8_activations=cuda_fast, fuse_scales=cuda_fast,
                   cpu_packed_decode=fast and device.type == "cpu",
                   float32_products=not fast and device.type == "cuda")
