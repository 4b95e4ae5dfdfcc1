"""slipstream: GGUF LLM inference that streams layers through the GPU from pinned RAM and NVMe."""

try:
    from .api import Model, load
except ModuleNotFoundError:  # TEMP while tokenizer lands
    pass
from .errors import SlipstreamError

__all__ = ["Model", "SlipstreamError", "load"]
__version__ = "0.1.0"
