"""Plain-URL downloads (stdlib urllib): into FILE.partial, resumed with an HTTP Range request
(guarded by If-Range, so a file that changed on the server starts over), moved to FILE only
once it is whole and starts with the GGUF magic."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import urllib.error
import urllib.request
from pathlib import Path

from rich.progress import Progress

from ..errors import ModelNotFound
from . import DownloadError
from .store import GGUF_MAGIC, PARTIAL_SUFFIX, SOURCE_SUFFIX, cache_dir, is_gguf

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
    HF_HUB_OFFLINE, slipstream's one switch for "no network", refuses it."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ModelNotFound(f"{url} is not in the cache and HF_HUB_OFFLINE is set: unset it "
                            f"to download")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # two pulls of one URL would append to one .partial: the second one waits its turn, then
    # finds the file whole (or resumes what the first left)
    locks = cache_dir() / "locks"  # apart, kept: deleting a lock file races its waiters
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(str(dest).encode()).hexdigest()[:16]
    with open(locks / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _download(url, dest, bar, label)


def _download(url: str, dest: Path, bar: Progress, label: str) -> Path:
    if is_gguf(dest) and not dest.with_name(dest.name + PARTIAL_SUFFIX).exists():
        return dest  # a concurrent pull finished it while this one waited for the lock
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    meta_path = dest.with_name(dest.name + SOURCE_SUFFIX)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = {}
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
                meta_path.write_text(json.dumps(meta))
            if total is not None:
                _check_space(dest.parent, total - start)
            bar.update(task, total=total, completed=start)
            done = start
            try:
                with open(partial, "ab" if start else "wb") as f:
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
        break
    if not is_gguf(partial):
        with open(partial, "rb") as f:
            head = f.read(16)
        partial.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
        raise DownloadError(f"{url} is not a GGUF file (it starts with {head!r}, not "
                            f"{GGUF_MAGIC!r}); nothing was kept")
    os.replace(partial, dest)  # atomic: the final name only ever holds a whole file
    return dest


class _Dropped(Exception):
    """The connection broke while the body streamed (the bytes so far are kept)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
