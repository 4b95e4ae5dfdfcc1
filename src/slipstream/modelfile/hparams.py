"""Hyper-parameters read out of a GGUF's metadata, each checked against its type and range:
the `md_*` readers ModelConfig.from_metadata and the families use. Apart from modelfile.validate
(which re-exports them) because that module imports the gguf package, and with it numpy: the
model families import these readers, and `slipstream --help` imports the families' table.

A failure is MissingMetadata or InvalidMetadata naming the key, the value and the range."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..errors import InvalidMetadata, MissingMetadata

FIX = "the file is corrupt or truncated: download it again or re-convert it"


_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def md_int(md: Mapping[str, Any], key: str, source: str, lo: int, hi: int,
           default: Any = _MISSING, per_layer: bool = False, hint: str = "") -> int:
    """An integer hyper-parameter in [lo, hi]. per_layer: a per-layer array is accepted when
    all its entries agree (slipstream runs uniform layers)."""
    if key not in md:
        if default is _MISSING:
            raise MissingMetadata(f"{source}: missing required metadata {key!r}")
        return default
    v = md[key]
    if per_layer and isinstance(v, list):
        vals = set(v)
        if len(vals) != 1:
            shown = v if len(v) <= 8 else [*v[:8], "..."]
            raise InvalidMetadata(
                f"{source}: metadata {key!r} is a per-layer array {shown} whose entries differ; "
                f"slipstream supports only models whose layers all have the same shape")
        v = v[0]
    if not _is_int(v):
        raise InvalidMetadata(f"{source}: metadata {key!r} is {v!r} ({type(v).__name__}), "
                              f"expected an integer; {FIX}")
    if not lo <= v <= hi:
        raise InvalidMetadata(f"{source}: metadata {key!r} is {v}, outside the valid range "
                              f"{lo}..{hi}{hint}; {FIX}")
    return v



def md_ints(md: Mapping[str, Any], key: str, source: str, lo: int, hi: int, n_layers: int,
            default: Any = _MISSING) -> tuple[int, ...]:
    """A per-layer integer hyper-parameter, one value per layer: an array of `n_layers`
    integers in [lo, hi], or one integer for every layer (families whose layers differ)."""
    v = md.get(key, default)
    if v is _MISSING:
        raise MissingMetadata(f"{source}: missing required metadata {key!r}")
    if not isinstance(v, list):
        return (md_int({key: v}, key, source, lo, hi),) * n_layers
    if len(v) != n_layers:
        raise InvalidMetadata(f"{source}: metadata {key!r} has {len(v)} entries for "
                              f"{n_layers} layers; {FIX}")
    return tuple(md_int({key: x}, key, source, lo, hi) for x in v)

def md_float(md: Mapping[str, Any], key: str, source: str, default: float, lo: float, hi: float,
             lo_open: bool = False, hint: str = "") -> float:
    """A finite float hyper-parameter in [lo, hi] ((lo, hi] with lo_open)."""
    if key not in md:
        return default
    v = md[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidMetadata(f"{source}: metadata {key!r} is {v!r} ({type(v).__name__}), "
                              f"expected a number; {FIX}")
    v = float(v)
    ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        bound = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise InvalidMetadata(f"{source}: metadata {key!r} is {v!r}; it must be a finite number "
                              f"in {bound}{hint}; {FIX}")
    return v


def _typed(md: Mapping[str, Any], key: str, source: str, default: Any, kind: type,
           expected: str) -> Any:
    v = md.get(key, default)
    if not isinstance(v, kind):
        raise InvalidMetadata(f"{source}: metadata {key!r} is {v!r} ({type(v).__name__}), "
                              f"expected {expected}; {FIX}")
    return v


def md_str(md: Mapping[str, Any], key: str, source: str, default: str) -> str:
    return _typed(md, key, source, default, str, "a string")


def md_bool(md: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    """A boolean hyper-parameter (GGUF's BOOL type)."""
    return _typed(md, key, source, default, bool, "a boolean")
