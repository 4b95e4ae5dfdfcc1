"""Launch plumbing shared by the small-m quantized GEMMs (qgemm.py, qgemm_wide.py): the
packed planes as kernel arguments, the format's constants, K split across programs into
float32 partials that are summed in a fixed order, so results do not depend on scheduling, and
the rows of x split across launches (in_row_blocks). Triton-free: CI tests it on the CPU."""

from __future__ import annotations

from typing import Callable

import torch

from .pack import PackedWeight


def planes(packed: PackedWeight) -> tuple[torch.Tensor, ...]:
    """lo, hi, d, m, sc, mn, sm: a plane the format lacks is passed as lo (never read)."""
    dummy = packed.lo
    return tuple(p if p is not None else dummy for p in
                 (packed.lo, packed.hi, packed.d, packed.m, packed.sc, packed.mn, packed.sm))


def format_constants(packed: PackedWeight) -> dict[str, object]:
    """The constexprs a kernel reads the planes by (pack.QSpec, and whether scales are fused)."""
    spec = packed.spec
    return dict(LO=spec.lo, HI=spec.hi, G=spec.group, OFF=spec.off, KQUANT=spec.kquant,
                HAS_MIN=spec.has_min, PACKED_SCMN=spec.packed_scmn, SM=packed.sm is not None)


def split_units(nut: int, nu: int, split: int) -> tuple[int, int]:
    """(units of 32 per program along K, programs along K): whole steps of nu units each."""
    steps = -(-nut // nu)
    units = -(-steps // split) * nu
    return units, -(-nut // units)


def outputs(m: int, n: int, split: int, out: torch.Tensor | None, out_dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """Where the programs write: y itself (out, or a new (m, n) tensor) without a split, float32
    partials (split, m, n) with one."""
    if split == 1:
        return out if out is not None else torch.empty(m, n, device=device, dtype=out_dtype)
    return torch.empty(split, m, n, device=device, dtype=torch.float32)


def finish(part: torch.Tensor, split: int, out: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """y from what the programs wrote: the partials summed in a fixed order."""
    if split == 1:
        return part
    y = part.sum(0)
    if out is not None:
        return out.copy_(y)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def in_row_blocks(launch: Callable[..., torch.Tensor], x: torch.Tensor, rows: int,
                  out: torch.Tensor | None, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y (m, n) from launch(x_block, y_block) on blocks of at most `rows` rows of x, each
    written into its rows of one output (`out` if given): for a kernel whose variant for more
    rows costs too much to compile (qgemm's exact one). Rows of x never meet in a sum, so the
    values are those of launching each block alone. A launch may return its result elsewhere
    than the block it was given (a split-K finish); it is copied in then."""
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    for r in range(0, m, rows):
        block = out[r:r + rows]
        y = launch(x[r:r + rows], block if block.is_contiguous() else None)
        if y.data_ptr() != block.data_ptr():
            block.copy_(y)
    return out
