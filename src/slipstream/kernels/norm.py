"""Fused RMSNorm, optionally with the residual add folded in.

`rms_norm(x, w, eps)`                 -> x / rms(x) * w
`rms_norm(x, w, eps, residual=r)`     -> (norm(x + r) * w, x + r): one read of x and r, one
                                         write of each output, instead of three kernels.
`rms_norm(x, w, eps, add_to=r)`       -> r + norm(x) * w: a post-norm (Gemma, GLM-4, OLMo 2
                                         norm a sublayer's output before the residual add),
                                         one kernel instead of two.
Statistics in fp32; the residual sum is rounded to the activation dtype first (as an unfused
`h = x + r; norm(h)` would be), so fused and unfused give the same numbers. The post-norm's sum
is formed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, H, stride_x, stride_r, stride_y,
                     stride_h, eps, HAS_RES: tl.constexpr, ADD_AFTER: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = xf * inv * w
    if ADD_AFTER:  # a post-norm: the residual added to the normed row
        y += tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, add_to: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x (..., H). With `residual`, returns (norm(x + residual),
    x + residual); with `add_to`, add_to + norm(x) in add_to's dtype."""
    h_dim = x.shape[-1]
    if weight.shape != (h_dim,):
        raise ValueError(f"weight must be ({h_dim},), got {tuple(weight.shape)}")
    x2 = x.reshape(-1, h_dim)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2)
    block = triton.next_power_of_2(h_dim)
    warps = min(16, max(1, block // 512))
    if add_to is not None:
        if residual is not None:
            raise ValueError("residual (added before the norm) and add_to (after it) are "
                             "two different forms: give one")
        r2 = add_to.reshape(-1, h_dim)
        if r2.shape != x2.shape or r2.stride(1) != 1:
            raise ValueError(f"add_to {tuple(add_to.shape)} must match x {tuple(x.shape)} "
                             f"with a contiguous last dim")
        y = torch.empty_like(r2)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, y, h_dim, x2.stride(0),
                                         r2.stride(0), y.stride(0), 0, eps, HAS_RES=False,
                                         ADD_AFTER=True, BLOCK=block, num_warps=warps)
        return y.reshape(add_to.shape)
    if residual is None:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, h_dim, x2.stride(0), 0,
                                         y.stride(0), 0, eps, HAS_RES=False, ADD_AFTER=False,
                                         BLOCK=block, num_warps=warps)
        return y.reshape(x.shape)
    r2 = residual.reshape(-1, h_dim)
    if r2.shape != x2.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if r2.stride(1) != 1:
        r2 = r2.contiguous()
    h = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, h, h_dim, x2.stride(0), r2.stride(0),
                                     y.stride(0), h.stride(0), eps, HAS_RES=True,
                                     ADD_AFTER=False, BLOCK=block, num_warps=warps)
    return y.reshape(x.shape), h.reshape(x.shape)
