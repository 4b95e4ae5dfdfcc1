"""Rotary position embeddings, in the two pairings GGUF models use.

llama.cpp's converter permutes the rows of Llama's Q and K so that dimensions (2i, 2i+1) form a
rotation pair ("normal" style). Qwen2 and other NEOX-style models are stored as trained and pair
dimension i with i + rope_dim/2. Using the wrong one gives a model that runs but talks nonsense,
which is why the pairing is tested against Hugging Face transformers, not guessed.
"""

from __future__ import annotations

import math

import torch

from ..modelfile.config import ModelConfig


def yarn(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's frequencies (cfg.rope_scaling "yarn"), as llama.cpp's rope_yarn and
    transformers compute them: a frequency that turns fewer than cfg.yarn_beta_slow times
    over the original context is divided by the factor (interpolated), one that turns more
    than cfg.yarn_beta_fast times is kept, and the pairs between mix the two along a
    linear ramp over their index."""
    dim, base = cfg.rope_dim, cfg.rope_base

    def pair_of(turns: float) -> float:  # the pair index that turns `turns` times
        return dim * math.log(cfg.rope_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(pair_of(cfg.yarn_beta_fast)), 0)
    hi = min(math.ceil(pair_of(cfg.yarn_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
    kept = 1.0 - ramp  # 1: the trained frequency, 0: divided by the factor
    return inv_freq / cfg.rope_scale * (1.0 - kept) + inv_freq * kept


class RopeTable:
    """cos/sin for every position up to max_pos, built once (float32, like HF)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, device: torch.device | str,
                 freq_factors: torch.Tensor | None = None):
        self.style = cfg.rope_style
        self.rope_dim = cfg.rope_dim
        exponent = torch.arange(0, cfg.rope_dim, 2, dtype=torch.int64).float() / cfg.rope_dim
        inv_freq = 1.0 / (cfg.rope_base ** exponent)  # (rope_dim/2,)
        if freq_factors is not None:
            # Llama 3.x stores its long-context frequency correction as a `rope_freqs` tensor
            # of per-frequency divisors; llama.cpp divides theta by it, and so do we.
            inv_freq = inv_freq / freq_factors.float().cpu()
        if cfg.rope_scaling == "yarn":
            inv_freq = yarn(inv_freq, cfg)
            positions = torch.arange(max_pos, dtype=torch.float32)
        else:
            positions = torch.arange(max_pos, dtype=torch.float32) / cfg.rope_scale
        angles = positions[:, None] * inv_freq[None, :]  # (max_pos, rope_dim/2)
        cos, sin = angles.cos(), angles.sin()
        if cfg.rope_attn_factor != 1.0:
            # LongRoPE's attention factor scales the rotated dimensions of queries and keys
            # (so their dot products by its square), as llama.cpp's mscale does
            cos, sin = cos * cfg.rope_attn_factor, sin * cfg.rope_attn_factor
        self.cos = cos.to(device)
        self.sin = sin.to(device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `apply` needs for positions (T,), computed once per forward for all layers.

        normal: (cis, unused) with cis complex64 (T, 1, rope_dim/2), so the rotation is one
        complex multiply of adjacent pairs viewed as complex numbers.
        neox: (cos, sin) each (T, 1, rope_dim) with the half-angle table repeated twice.
        """
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        if self.style == "normal":
            return torch.complex(cos, sin), cos
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def apply(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x (T, heads, head_dim) by `angles(positions)`; dims past rope_dim pass.

        The result is float32 whatever x's dtype: attention consumes it next, and casting back
        would only round it."""
        T, heads, head_dim = x.shape
        partial = self.rope_dim < head_dim
        rot = x[..., : self.rope_dim] if partial else x
        rot = rot.float()
        if self.style == "normal":
            pairs = torch.view_as_complex(rot.reshape(T, heads, self.rope_dim // 2, 2))
            out = torch.view_as_real(pairs * angles[0]).reshape(T, heads, self.rope_dim)
        else:
            cos, sin = angles
            half = self.rope_dim // 2
            rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
            out = rot * cos + rotated * sin
        return torch.cat((out, x[..., self.rope_dim:].float()), dim=-1) if partial else out
