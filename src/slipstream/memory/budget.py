"""Memory budgets: parsing sizes like "24GiB", and reading what the machine has free."""

from __future__ import annotations

import re

from ..errors import BadArgument

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str | int | float | None) -> int | None:
    """'24GiB', '512MB', '1.5g' or a plain number of bytes -> bytes (None passes through)."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise BadArgument(f"size {text!r} is not understood; write e.g. 24GiB, 512MiB or 12GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
