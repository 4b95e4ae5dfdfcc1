"""Hub downloads through huggingface_hub: it resolves the file (HF_ENDPOINT, HF_TOKEN, gated
and private repositories, redirects to a CDN or Xet storage), checks the ETag against what the
cache holds, and resumes a connection that drops mid-file with a Range request. slipstream
adds its own bar, the GGUF check, and one-line errors."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

from rich.progress import Progress

from ..errors import ModelNotFound
from . import DownloadError
from .refs import HubRef
from .store import CachedModel, hub_dir, is_gguf, remove

_TRUE = {"1", "ON", "YES", "TRUE"}


def endpoint() -> str:
    # read at call time: huggingface_hub reads HF_ENDPOINT once, when it is first imported
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def offline_error(ref: HubRef) -> ModelNotFound:
    return ModelNotFound(f"{ref} is not in the cache ({hub_dir(ref)}) and HF_HUB_OFFLINE is "
                         f"set: unset it to download, or pull it where the Hub is reachable")


def download(ref: HubRef, bar: Progress) -> Path:
    """Download (or find up to date in the cache) the Hub file `ref`; returns its path."""
    from huggingface_hub import errors as hfe
    from huggingface_hub import hf_hub_download

    from .progress import hub_tqdm

    local_dir = hub_dir(ref)
    if offline():
        path = local_dir / ref.filename
        if is_gguf(path):
            return path
        raise offline_error(ref)
    where = endpoint()
    # its retries' log lines would break the one-line error; the bar shows the progress
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            # huggingface_hub only warns when the disk lacks the room for the file; refuse
            warnings.filterwarnings("error", message="Not enough free disk space")
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
