"""Plain-URL downloads (stdlib urllib): into FILE.partial beside FILE, resumed with an HTTP
Range request (guarded by If-Range, so a file that changed on the server starts over), moved to
FILE only once it is whole (the server's size, or with none, every tensor of the GGUF inside
the file) and starts with the GGUF magic, and never over a file slipstream did not write."""

from __future__ import annotations

import errno
import fcntl
import http.client
import json
import os
import re
import shutil
import socket
import stat
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.progress import Progress

from ..errors import ModelNotFound
from . import DownloadError
from .store import GGUF_MAGIC, LOCK_SUFFIX, PARTIAL_SUFFIX, SOURCE_SUFFIX, is_gguf, prune
from .whole import missing

CHUNK = 1 << 20
RETRIES = 3  # connections dropped mid-body and resumed within one pull
TIMEOUT_S = 30.0
# the exceptions of a connection that broke mid-transfer (resumable), not of our own disk
_NETWORK_ERRORS = (http.client.IncompleteRead, http.client.HTTPException, ConnectionError,
                   socket.timeout, TimeoutError, urllib.error.URLError)


def _request(url: str, start: int, validator: str | None):
    headers = {"User-Agent": "slipstream", "Accept-Encoding": "identity"}
    if start:
        headers["Range"] = f"bytes={start}-"
        if validator:
            headers["If-Range"] = validator
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                  timeout=TIMEOUT_S)


def _total_size(resp, start: int) -> int | None:
    """The whole file's size: from Content-Range on a 206, else Content-Length. Raises
    _BadRange for a 206 of a range other than the one asked for."""
    if resp.status == 206:
        m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", ""))
        if m is None or int(m.group(1)) != start:
            raise _BadRange(resp.headers.get("Content-Range"))
        return int(m.group(2)) if m.group(2) != "*" else None
    n = resp.headers.get("Content-Length")
    return int(n) if n and n.isdigit() else None


class _BadRange(Exception):
    """A 206 answer for bytes we did not ask for."""


def _check_space(directory: Path, need: int) -> None:
    free = shutil.disk_usage(directory).free
    if need > free:
        raise DownloadError(f"not enough disk space in {directory}: the download needs "
                            f"{need / 2**20:,.1f} MiB more, {free / 2**20:,.1f} MiB are free")


def download(url: str, dest: Path, bar: Progress, label: str) -> Path:
    """Download `url` to `dest` (resuming dest.partial if an earlier pull left one).
    HF_HUB_OFFLINE, slipstream's one switch for "no network", refuses it. Whatever happens,
    the cache keeps nothing of a failed pull but the partial file and what resumes it (its
    .source.json): no lock file, no empty folder."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ModelNotFound(f"{url} is not in the cache and HF_HUB_OFFLINE is set: unset it "
                            f"to download")
    try:
        with _locked(dest.with_name(dest.name + LOCK_SUFFIX)):
            try:
                return _download(url, dest, bar, label)
            except BaseException:
                _drop_if_empty(dest)
                raise
    finally:
        prune(dest.parent)


def _drop_if_empty(dest: Path) -> None:
    """An empty partial resumes nothing: it goes, with its .source.json (under the lock)."""
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    try:
        if partial.stat().st_size == 0:
            partial.unlink()
            if not os.path.lexists(dest):  # else it records whose file dest is
                dest.with_name(dest.name + SOURCE_SUFFIX).unlink(missing_ok=True)
    except OSError:
        pass  # none there, or it cannot go: the error that brought us here is the one to tell


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created), and delete it on the way out. Two pulls of
    one URL would append to one .partial: the second waits its turn, then finds the file
    whole (or resumes what the first left). Deleting a lock file is safe because it is
    deleted only by its holder, and a waiter that wakes on a deleted one retries on the
    new one; the folder may be pruned by a pull that just failed, so it is made again."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue  # the folder was pruned between mkdir and open
        except OSError as e:  # ELOOP: a symlink under the lock's name
            raise DownloadError(f"cannot lock {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # its holder deleted it while this pull waited: lock the one there now
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _download(url: str, dest: Path, bar: Progress, label: str) -> Path:
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    meta_path = dest.with_name(dest.name + SOURCE_SUFFIX)
    if is_gguf(dest) and not partial.exists():
        return dest  # a concurrent pull finished it while this one waited for the lock
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = {}
    if not isinstance(meta, dict):
        meta = {}
    if os.path.lexists(dest) and not _ours(dest, meta):
        raise DownloadError(f"{dest} exists and slipstream did not download it there; "
                            f"move it away to pull {url}")
    if meta.get("url") != url:  # a partial of some other URL that mapped to this path
        partial.unlink(missing_ok=True)
        meta = {"url": url}
    task = bar.add_task(label, total=None)
    failures = 0
    while True:
        start = partial.stat().st_size if partial.exists() else 0
        try:
            resp = _request(url, start, meta.get("etag") or meta.get("last_modified"))
        except urllib.error.HTTPError as e:
            if e.code == 416 and start:  # the partial is not a prefix of the file any more
                partial.unlink()
                continue
            if e.code in (404, 410):
                raise ModelNotFound(f"{url} does not exist (HTTP {e.code})") from None
            raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
        except _NETWORK_ERRORS as e:
            reason = getattr(e, "reason", e)
            raise DownloadError(f"cannot reach {url}: {reason}") from None
        with resp:
            try:
                total = _total_size(resp, start)
            except _BadRange as e:
                failures += 1
                if failures > RETRIES:
                    raise DownloadError(f"{url} answers a range request with bytes {e}, "
                                        f"not from {start}") from None
                partial.unlink()  # start over: the server's ranges cannot be trusted
                continue
            if resp.status != 206:
                start = 0  # the server sent the whole file: start over
            if start == 0:
                meta.update(etag=resp.headers.get("ETag"),
                            last_modified=resp.headers.get("Last-Modified"))
                _write_meta(meta_path, meta)
            if total is not None:
                _check_space(dest.parent, total - start)
            bar.update(task, total=total, completed=start)
            done = start
            try:
                with _open_partial(partial, append=bool(start)) as f:
                    while True:
                        try:
                            chunk = resp.read(CHUNK)
                        except _NETWORK_ERRORS as e:
                            raise _Dropped(e) from None
                        if not chunk:
                            break
                        f.write(chunk)
                        done += len(chunk)
                        bar.update(task, completed=done)
            except _Dropped as e:
                failures += 1
                if failures > RETRIES:
                    raise DownloadError(f"the download of {url} broke off at {done:,} of "
                                        f"{total or 0:,} bytes ({e}), {failures} times; run "
                                        f"the same command again to resume") from None
                continue
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise DownloadError(f"the disk is full: {partial} stopped at {done:,} "
                                        f"bytes; free some space and pull again to resume"
                                        ) from None
                raise DownloadError(f"cannot write {partial}: {e.strerror}") from None
        if total is not None and done != total:
            failures += 1
            if failures > RETRIES:
                raise DownloadError(f"the download of {url} ended at {done:,} of {total:,} "
                                    f"bytes; run the same command again to resume")
            continue
        if (total is not None or done >= len(GGUF_MAGIC)) and not is_gguf(partial):
            with open(partial, "rb") as f:
                head = f.read(16)
            partial.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)
            raise DownloadError(f"{url} is not a GGUF file (it starts with {head!r}, not "
                                f"{GGUF_MAGIC!r}); nothing was kept")
        # no size from the server: the GGUF's own header says where its last tensor ends
        why = missing(partial) if total is None else None
        if why is not None:
            failures += 1
            if failures > RETRIES:
                raise DownloadError(f"the download of {url} ended at {done:,} bytes, with no "
                                    f"size from the server, and is no whole GGUF ({why}); "
                                    f"run the same command again to resume")
            continue
        break
    _publish(partial, dest, meta, meta_path)
    return dest


def _open_partial(partial: Path, append: bool):
    # O_NOFOLLOW: the partial is written where it is, never through a symlink planted there
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_TRUNC
    return os.fdopen(os.open(partial, flags, 0o644), "ab" if append else "wb")


def _write_meta(meta_path: Path, meta: dict) -> None:
    # through a new file renamed over it: a rename replaces a symlink there, never its target
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                               0o644), "w") as f:
            f.write(json.dumps(meta))
        os.replace(tmp, meta_path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DownloadError(f"cannot write {meta_path}: {e.strerror}") from None


def _ours(dest: Path, meta: dict) -> bool:
    """Whether `dest` is the file slipstream last moved there (its .source.json recorded the
    file's device, inode, size and mtime as it renamed it), not one it never wrote."""
    try:
        st = os.stat(dest, follow_symlinks=False)
    except FileNotFoundError:
        return True
    mine = meta.get("file")
    return (stat.S_ISREG(st.st_mode) and isinstance(mine, dict)
            and mine == {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
                         "mtime_ns": st.st_mtime_ns})


def _publish(partial: Path, dest: Path, meta: dict, meta_path: Path) -> None:
    """Move the whole `partial` to `dest`, never over a file slipstream did not write: where
    `dest` is absent, through a hard link, which fails rather than replace a file that
    appeared meanwhile; where it is slipstream's own, by an atomic rename over it."""
    st = partial.stat()  # a rename keeps the inode, size and mtime
    meta["file"] = {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns}
    _write_meta(meta_path, meta)
    if os.path.lexists(dest):
        os.replace(partial, dest)  # _ours(dest) held under the lock
        return
    try:
        os.link(partial, dest)
    except FileExistsError:
        raise DownloadError(f"{dest} appeared while {partial.name} downloaded and slipstream "
                            f"did not write it; it was left alone (so is the download)"
                            ) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise DownloadError(f"cannot move {partial} to {dest}: {e.strerror}") from None
        os.replace(partial, dest)  # a filesystem without hard links: checked just above
        return
    partial.unlink()


class _Dropped(Exception):
    """The connection broke while the body streamed (the bytes so far are kept)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
