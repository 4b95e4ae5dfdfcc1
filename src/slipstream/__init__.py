"""slipstream: GGUF LLM inference that streams layers through the GPU from pinned RAM and NVMe."""

from .api import Model, load, plan
from .errors import SlipstreamError

__all__ = ["Model", "SlipstreamError", "load", "plan"]
__version__ = "0.1.0"
