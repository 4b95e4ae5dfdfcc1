"""slipstream: GGUF LLM inference that streams layers through the GPU from pinned RAM and NVMe."""

from .api import Model, load
from .errors import SlipstreamError

__all__ = ["Model", "SlipstreamError", "load"]
__version__ = "0.1.0"
