"""Launch plumbing shared by the small-m quantized GEMMs (qgemm.py, qgemm_wide.py): the
packed planes as kernel arguments, the format's constants, and K split across programs into
float32 partials that are summed in a fixed order, so results do not depend on scheduling."""

from __future__ import annotations

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
