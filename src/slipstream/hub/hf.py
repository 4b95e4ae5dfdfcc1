"""Hub downloads through huggingface_hub: it resolves the file (HF_ENDPOINT, HF_TOKEN, gated
and private repositories, redirects to a CDN or Xet storage), checks the ETag against what the
cache holds, and resumes a connection that drops mid-file with a Range request. slipstream
adds its own bar, the GGUF check, one-line errors, and the resumption of a pull that was
killed: huggingface_hub 2.x downloads into a temporary file of its own per process and never
reuses one a dead process left (`_resume_killed`)."""

from __future__ import annotations

import errno
import os
import shutil
import ssl
import threading
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from rich.progress import Progress

from ..errors import ModelNotFound
from . import DownloadError
from .progress import hub_tqdm
from .refs import HubRef
from .store import CachedModel, hub_dir, hub_file, is_gguf, prune, remove

_TRUE = {"1", "ON", "YES", "TRUE"}
# One try, this long, before a Hub pull says the Hub is out of reach: huggingface_hub itself
# retries a failed connection 5 times with back-off (24 s in silence before its error), and
# up to its 10 s timeout per try where packets are dropped. A reachable Hub answers in well
# under a second, even across an ocean (a TLS handshake is 3 round trips of <= 0.3 s).
PROBE_TIMEOUT_S = 2.0
_HF_MARKERS = {".gitignore", "CACHEDIR.TAG"}  # what huggingface_hub writes in every local_dir


def endpoint() -> str:
    # read at call time: huggingface_hub reads HF_ENDPOINT once, when it is first imported
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    # huggingface_hub loads only when a Hub reference is used: it is heavy, and it reads the
    # HF_* variables once, at its first import (as in every function of this module)
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def offline_error(ref: HubRef) -> ModelNotFound:
    return ModelNotFound(f"{ref} is not in the cache ({hub_dir(ref)}) and HF_HUB_OFFLINE is "
                         f"set: unset it to download, or pull it where the Hub is reachable")


def download(ref: HubRef, bar: Progress) -> Path:
    """Download (or find up to date in the cache) the Hub file `ref`; returns its path. A
    failed pull leaves only what resumes it (huggingface_hub's .incomplete file)."""
    local_dir = hub_dir(ref)
    path = hub_file(ref)  # before huggingface_hub joins local_dir and the file name itself
    if offline():
        if is_gguf(path):
            return path
        raise offline_error(ref)
    where = endpoint()
    if (why := unreachable(where)) is not None:
        if is_gguf(path):
            return path  # what huggingface_hub does too when the Hub does not answer
        raise DownloadError(f"cannot reach {where} to fetch {ref} ({why}): offline? It is not "
                            f"in the cache") from None
    try:
        return _download(ref, local_dir, where, bar)
    except BaseException:
        try:
            _clean_failed(ref, local_dir)
        except OSError:
            pass  # tidying up must not hide why the pull failed
        raise


def unreachable(where: str) -> str | None:
    """None when `where` answers an HTTP request within PROBE_TIMEOUT_S (any status, or a
    TLS handshake that fails on a certificate: something is there), else why not. The request
    runs in a thread, so that a name lookup that hangs (which no socket timeout bounds) is cut
    off too; the thread is left to end on its own."""
    result: list[str | None] = []

    def probe() -> None:
        req = urllib.request.Request(where + "/", method="HEAD",
                                     headers={"User-Agent": "slipstream"})
        try:
            urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S).close()
            result.append(None)
        except urllib.error.HTTPError:
            result.append(None)  # an HTTP answer: the Hub (or a proxy before it) is there
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLError):
                result.append(None)  # a TLS handshake: the host is there
            elif isinstance(e.reason, BaseException):
                result.append(_first_line(e.reason))
            else:
                result.append(str(e.reason))
        except (OSError, ValueError) as e:
            result.append(_first_line(e))
        except Exception:  # http.client's errors: a connection was made
            result.append(None)

    t = threading.Thread(target=probe, name="hub-probe", daemon=True)
    t.start()
    t.join(PROBE_TIMEOUT_S)
    return result[0] if result else f"no answer within {PROBE_TIMEOUT_S:g} s"


def _download(ref: HubRef, local_dir: Path, where: str, bar: Progress) -> Path:
    # local: huggingface_hub loads only when a Hub reference is used (see offline)
    from huggingface_hub import errors as hfe
    from huggingface_hub import hf_hub_download

    # its retries' log lines would break the one-line error; the bar shows the progress
    from huggingface_hub.utils import logging as hf_logging  # local: see offline

    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            # huggingface_hub only warns when the disk lacks the room for the file; refuse
            warnings.filterwarnings("error", message="Not enough free disk space")
            _resume_killed(ref, local_dir, where, bar)
            path = Path(hf_hub_download(ref.repo_id, ref.filename, revision=ref.revision,
                                        local_dir=local_dir, endpoint=where,
                                        tqdm_class=hub_tqdm(bar, ref.filename)))
    except hfe.GatedRepoError:
        raise ModelNotFound(f"{ref.repo_id} on {where} is gated: accept its terms on the Hub "
                            f"and set HF_TOKEN") from None
    except hfe.RepositoryNotFoundError:
        raise ModelNotFound(f"repository {ref.repo_id} not found on {where} (if it is "
                            f"private, set HF_TOKEN)") from None
    except hfe.RevisionNotFoundError:
        raise ModelNotFound(f"{ref.repo_id} has no revision {ref.revision!r} on {where}"
                            ) from None
    except hfe.RemoteEntryNotFoundError:
        raise ModelNotFound(f"{ref.repo_id} has no file {ref.filename!r} on {where}"
                            ) from None
    except hfe.OfflineModeIsEnabled:
        raise offline_error(ref) from None
    except hfe.LocalEntryNotFoundError as e:
        # huggingface_hub's word for "the Hub did not answer and the cache lacks the file"
        cause = e.__cause__ or e.__context__
        reason = f" ({_first_line(cause)})" if cause else ""
        raise DownloadError(f"cannot reach {where} to fetch {ref}{reason}, and it is not in "
                            f"the cache") from None
    except hfe.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise DownloadError(f"{where} answered HTTP {status} for {ref}") from None
    except UserWarning as e:
        raise DownloadError(f"not enough disk space for {ref}: {e}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DownloadError(f"the disk is full ({local_dir}); free some space and pull "
                                f"again") from None
        raise DownloadError(f"the download of {ref} failed: {_first_line(e)}") from None
    except Exception as e:
        # httpx2's transport errors (a connection that stayed down through huggingface_hub's
        # retries), a server that is not Hub-like (FileMetadataError, an OSError above)
        if type(e).__module__.split(".")[0] not in ("httpx2", "httpx", "httpcore"):
            raise
        raise DownloadError(f"the download of {ref} from {where} failed: {_first_line(e)}"
                            ) from None
    if not is_gguf(path):
        remove(CachedModel(ref.name, path, 0, ""))
        raise DownloadError(f"{ref} is not a GGUF file (no GGUF magic); nothing was kept")
    return path


def _clean_failed(ref: HubRef, local_dir: Path) -> None:
    """After a failed Hub pull, delete what huggingface_hub left that resumes nothing: the
    file's lock (only when no other pull holds it: a lock file may be deleted only by its
    holder) and the folders left empty; its .incomplete file, resumable, stays."""
    try:  # local: see offline; private names may go
        from filelock import FileLock, Timeout
        from huggingface_hub._local_folder import get_local_download_paths
    except ImportError:
        return
    if not local_dir.is_dir():
        return
    paths = get_local_download_paths(local_dir, ref.filename)
    lock = FileLock(paths.lock_path, timeout=0)
    try:
        lock.acquire()
    except (Timeout, OSError):
        return
    try:
        paths.lock_path.unlink(missing_ok=True)
    finally:
        lock.release()
    meta_root = local_dir / ".cache" / "huggingface"
    # huggingface_hub's .cache/huggingface/ holds markers of its own (.gitignore, CACHEDIR.TAG)
    # and download/...; with no metadata, lock or .incomplete left, all of it may go
    if meta_root.is_dir() and not any(p.is_file() and p.name not in _HF_MARKERS
                                      for p in meta_root.rglob("*")):
        shutil.rmtree(local_dir / ".cache", ignore_errors=True)
    prune(paths.file_path.parent)


def _resume_killed(ref: HubRef, local_dir: Path, where: str, bar: Progress) -> None:
    """Finish the file a killed pull of `ref` left, where the Hub still serves the same file.

    huggingface_hub (2.x) downloads into `<hash>.<etag>.<random>.incomplete` beside its
    metadata and deletes it on any error it sees, but a process that is killed leaves it, and
    the next pull starts a new one from byte 0: a pull killed at 30 of 40 GB costs 30 GB more,
    and the 30 GB stay on disk unseen. So, holding huggingface_hub's own lock for the file (no
    pull of it is running): the largest leftover of the ETag the Hub now answers is resumed
    with a Range request from its length (huggingface_hub's http_get, which also copes with
    a server that ignores the Range), moved into place with huggingface_hub's metadata, so that
    hf_hub_download finds the file up to date; every other leftover (another ETag: the file
    changed) is deleted. Files the Hub serves through Xet storage are left to hf_xet, whose
    chunk cache keeps what a killed pull fetched. Where huggingface_hub's layout is not the
    one known here, nothing is done and the pull starts over as before."""
    try:  # local: huggingface_hub (and its filelock) load only for the Hub; private names may go
        from filelock import FileLock, Timeout
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub._local_folder import (get_local_download_paths,
                                                   write_download_metadata)
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers
    except ImportError:
        return
    paths = get_local_download_paths(local_dir, ref.filename)
    prefix = paths.incomplete_path("ETAG").name.split(".")[0]  # the file's short hash
    if not list(paths.metadata_path.parent.glob(f"{prefix}.*.incomplete")):
        return
    lock = FileLock(paths.lock_path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return  # a pull of this file is running: what it writes is not ours to touch
    try:
        left = sorted(paths.metadata_path.parent.glob(f"{prefix}.*.incomplete"),
                      key=lambda f: f.stat().st_size, reverse=True)
        url = hf_hub_url(ref.repo_id, ref.filename, revision=ref.revision, endpoint=where)
        meta = get_hf_file_metadata(url)
        plain = meta.xet_file_data is None and meta.location and meta.size
        keep = next((f for f in left if plain and f.name.split(".")[1] == meta.etag
                     and f.stat().st_size <= meta.size), None)
        for f in left:
            if f is not keep:
                f.unlink(missing_ok=True)
        if keep is None:
            return
        with open(keep, "r+b") as f:
            f.seek(0, os.SEEK_END)
            http_get(meta.location, f, resume_size=f.tell(), headers=build_hf_headers(),
                     expected_size=meta.size, displayed_filename=ref.filename,
                     tqdm_class=hub_tqdm(bar, ref.filename))
        os.replace(keep, paths.file_path)
    finally:
        lock.release()
    # after the release: huggingface_hub takes the same lock to write it, through a lock
    # object of its own, which would wait for ours for ever
    write_download_metadata(local_dir, ref.filename, meta.commit_hash, meta.etag)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
