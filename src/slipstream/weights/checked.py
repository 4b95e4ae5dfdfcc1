"""Which tensors of a model file have passed the value checks (weights.checks), kept next to
the model (MODEL.slipstream-checked.json, or in the cache where its folder is not writable:
hub.store.written_path), so that a later load of the unchanged file does not read their bytes
again.

The checks read every block scale of the resident weights: a pass over their bytes through
the memory map before a byte is built. On the device's host that pass took 10 s of a warm
41 s load of a 70B at 24 GiB (20 GB of resident weights), where llama.cpp's whole load took
9.8 s. The record holds the file's identity (size, mtime, inode) and the checks' version: a
file changed in any way, or checks made stricter, are checked again. Only tensors that passed
are recorded, so a bad file fails at every load. A record that cannot be read or written is
no record: the checks run, and the load goes on.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..hub.store import written_path

KIND = "slipstream-checked.json"
# bump when weights.checks' bounds or fields change what passes
CHECKS_VERSION = 1


def _identity(model: Path) -> list[int]:
    st = model.stat()
    return [CHECKS_VERSION, st.st_size, st.st_mtime_ns, st.st_ino]


def passed(model: Path) -> set[str]:
    """The tensors of `model` that passed the checks as it is now (empty where none did)."""
    try:
        doc = json.loads(written_path(model, KIND).read_text())
        if doc.get("file") != _identity(model):
            return set()
        return set(doc["passed"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def record(model: Path, names: Iterable[str]) -> None:
    """Add `names` to the tensors of `model` that passed; written to a temporary name and
    renamed, so a reader never meets half a record."""
    names = set(names)
    if not names:
        return
    try:
        path = written_path(model, KIND)
        doc = {"file": _identity(model), "passed": sorted(passed(model) | names)}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                f.write(json.dumps(doc))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only cache or a full disk: the next load checks again
