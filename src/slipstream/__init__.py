"""slipstream: GGUF LLM inference that streams layers through the GPU from pinned RAM and NVMe."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads (torch's, and native/'s through the same libgomp) spin while they wait for
# work unless told otherwise, which libgomp reads once, when torch loads it. On a 2-core
# machine with other work running, the spinning thread takes the core the working one needs:
# the default model decoded at 2.5-7.4 tok/s with 2 threads spinning, 50-63 passive, 70-80
# with one thread. Set before torch is imported (a process that imported torch first keeps
# its own policy); OMP_WAIT_POLICY=ACTIVE in the environment keeps spinning. Not on a machine
# with an NVIDIA GPU: hybrid decode hands each layer's FFN share to threads kept awake between
# layers (native/q4_matvec.c, ss_omp_touch), whose speed was measured with libgomp's default,
# and passive waiting there is not measured yet.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .errors import SlipstreamError  # noqa: E402 (after the policy, though torch-free)

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
