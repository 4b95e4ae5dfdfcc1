"""Paths inside the cache, built only from checked components.

Every cache path slipstream derives from outside text (a URL's host and segments after
percent-decoding, a Hub repository id and file name) goes through `inside`: each component
must be one plain directory entry name, and the joined path, with every symlink that exists
resolved, must still lie in the resolved cache directory. Without it, a URL segment `%2F` made
an absolute path and `..%2F` climbed out of the cache, so a pull could overwrite any file the
user can write; a symlinked folder inside the cache let `rm` delete a file outside it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadArgument

NAME_MAX = 255  # bytes in one directory entry name on Linux, macOS and Windows filesystems


class UnsafePath(BadArgument):
    """A name, URL or Hub id would place a file outside the cache (an absolute component,
    '..', a separator after percent-decoding, a symlink out of the cache)."""


def component(part: str, what: str) -> str:
    """`part` itself when it is one plain directory entry name; UnsafePath naming it (and
    `what` it came from) otherwise."""
    why = None
    if part in ("", "."):
        why = "is empty or '.'"
    elif part == "..":
        why = "climbs to the folder above"
    elif "/" in part or "\\" in part:
        why = "holds a path separator"  # '\\' too: a separator where the cache may be copied
    elif "\0" in part:
        why = "holds a NUL byte"
    else:
        try:
            if len(os.fsencode(part)) > NAME_MAX:
                why = f"is longer than {NAME_MAX} bytes"
        except UnicodeEncodeError:  # a lone surrogate: no file name can hold it
            why = "is not encodable as a file name"
    if why is not None:
        raise UnsafePath(f"{what}: the path component {part!r} {why}, so it cannot name a "
                         f"file inside the cache")
    return part


def inside(root: Path, parts: tuple[str, ...] | list[str], what: str) -> Path:
    """root/parts..., each part checked by `component`, and the result checked to lie in
    `root` after resolving every symlink that exists on the way."""
    path = root.joinpath(*(component(p, what) for p in parts))
    return check_inside(root, path, what)


def check_inside(root: Path, path: Path, what: str, follow_last: bool = True) -> Path:
    """`path` when, resolved, it lies in resolved `root`; UnsafePath otherwise. With
    `follow_last` False the last component may itself be a symlink (one that `unlink`
    removes without touching its target); only the folders above it are resolved."""
    real_root = root.resolve()
    target = path if follow_last else path.parent
    real = target.resolve()
    if real != real_root and real_root not in real.parents:
        raise UnsafePath(f"{what}: {path} resolves to {real}, outside the cache {real_root} "
                         f"(through '..' or a symlink); refused")
    return path
