"""slipstream: GGUF LLM inference that streams layers through the GPU from pinned RAM and NVMe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import SlipstreamError

if TYPE_CHECKING:
    from .api import Model, Placement, SelfDraft, load, plan

__all__ = ["Model", "Placement", "SelfDraft", "SlipstreamError", "load", "plan"]
__version__ = "0.1.0"

_API = ("Model", "Placement", "SelfDraft", "load", "plan")


def __getattr__(name: str):
    # The API (and torch under it) is imported on first use, so that `slipstream --help`,
    # `slipstream info` and `import slipstream.errors` do not pay for torch.
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
