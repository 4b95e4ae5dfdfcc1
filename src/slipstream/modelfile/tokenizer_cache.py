"""A GGUF file's tokenizer, built once and kept in a cache folder keyed by the file's identity.

Building the tokenizer from the file's `tokenizer.ggml.*` metadata (tokenizer.Tokenizer.
from_metadata) decodes ~49k token strings and ~49k merges and builds the BPE model from them:
0.21 s of a 0.68 s load of the default model on an idle 2-core machine, 0.8 s under load.
Read back from the cache (tokenizers.Tokenizer.from_str and the per-token bytes), it skips the
metadata's string decoding and our merge parsing and checks.

The cached form is the built object's attributes, each in a JSON form of its type (byte
strings as one hex string and their lengths, id sets as lists; the tokenizers backend as its
own JSON, on a line after them), restored onto a Tokenizer without running its constructor.
The key covers what the result depends on: the model file's path, size, mtime and inode, the
tokenizers library's version and the source of the modules that build it (tokenizer.py,
vocab.py), so a changed file or a changed builder never reads an old entry. A missing,
unreadable or damaged entry is rebuilt from the file and written again; a folder that cannot
be written only costs the next load the build.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import tokenizers

from .gguf_file import GGUFFile
from .tokenizer import Tokenizer

FORMAT = 2  # bump when the encoding below changes
# the modules whose code decides what a built tokenizer holds
_SOURCES = (Path(__file__).with_name("tokenizer.py"), Path(__file__).with_name("vocab.py"))
KEEP = 16  # entries kept in the folder: the oldest beyond this are removed after a write


class _Uncachable(Exception):
    """An attribute of a type this module does not encode: the tokenizer is not cached."""


def cache_key(path: Path) -> str:
    """What a cache entry for the model at `path` is named by (see the module doc)."""
    st = path.stat()
    h = hashlib.sha256(f"{FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|"
                       f"{tokenizers.__version__}".encode())
    for src in _SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:32]


def _encode(value: Any, backends: list[str]) -> dict[str, Any]:
    if isinstance(value, tokenizers.Tokenizer):
        backends.append(value.to_str())
        return {"t": "tokenizer", "v": len(backends) - 1}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"t": "plain", "v": value}
    if isinstance(value, frozenset) and all(isinstance(i, int) for i in value):
        return {"t": "ids", "v": sorted(value)}
    if isinstance(value, list) and all(isinstance(b, bytes) for b in value):
        return {"t": "bytes", "v": b"".join(value).hex(), "n": [len(b) for b in value]}
    raise _Uncachable(type(value).__name__)


def _decode(item: dict[str, Any], backends: list[str]) -> Any:
    kind, v = item["t"], item["v"]
    if kind == "tokenizer":
        return tokenizers.Tokenizer.from_str(backends[v])
    if kind == "plain":
        return v
    if kind == "ids":
        return frozenset(v)
    if kind == "bytes":
        joined, out, at = bytes.fromhex(v), [], 0
        for n in item["n"]:
            out.append(joined[at:at + n])
            at += n
        if at != len(joined):
            raise ValueError("the byte strings' lengths do not add up")
        return out
    raise ValueError(f"unknown entry kind {kind!r}")


def encode(tok: Tokenizer) -> str:
    """The tokenizer as the cache's text (_Uncachable for an attribute it cannot hold): a line
    of JSON holding its attributes, then each tokenizers backend's own JSON on a line of its
    own, as the library writes it (compact: no raw newline). Not nested as a JSON string:
    unescaping the default model's 3 MB backend took json.loads 13 ms of each load, and the
    pieces, one hex string and their lengths rather than 49k strings, 9 ms of fromhex."""
    backends: list[str] = []
    head = json.dumps({k: _encode(v, backends) for k, v in vars(tok).items()})
    return "\n".join([head, *backends])


def decode(text: str) -> Tokenizer:
    """The Tokenizer `encode` wrote (ValueError, KeyError, TypeError, IndexError or an error
    of the tokenizers library where the text is damaged)."""
    head, *backends = text.split("\n")
    state = json.loads(head)
    tok = Tokenizer.__new__(Tokenizer)
    tok.__dict__.update({k: _decode(v, backends) for k, v in state.items()})
    return tok


def is_cached(gf: GGUFFile, folder: Path) -> bool:
    """Whether `folder` holds an entry for `gf` as it is now (built once, so it builds)."""
    try:
        return (folder / f"{cache_key(Path(gf.path))}.json").is_file()
    except OSError:
        return False


def load_tokenizer(gf: GGUFFile, folder: Path | None) -> Tokenizer:
    """The tokenizer of `gf`, from `folder`'s cache entry where one matches the file, else
    built from its metadata (Tokenizer.from_metadata: its errors as they are) and cached.
    folder=None: built, not cached."""
    if folder is None:
        return Tokenizer.from_metadata(gf.metadata)
    try:
        entry = folder / f"{cache_key(Path(gf.path))}.json"
    except OSError:  # the model's stat, or our own sources, unreadable: build as before
        return Tokenizer.from_metadata(gf.metadata)
    try:
        return decode(entry.read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    except Exception:  # noqa: BLE001 (a damaged entry of any kind is rebuilt and replaced)
        pass
    tok = Tokenizer.from_metadata(gf.metadata)
    try:
        _write(entry, encode(tok))
    except (OSError, _Uncachable):  # a cache: the next load builds it again
        pass
    return tok


def _write(entry: Path, text: str) -> None:
    """Write `entry` whole or not at all (a temporary name in its folder, then a rename), and
    keep the folder to its KEEP newest entries."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tok-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, entry)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    entries = sorted(entry.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in entries[:-KEEP]:
        old.unlink(missing_ok=True)
