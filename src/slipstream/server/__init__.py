"""An OpenAI-compatible HTTP server over one slipstream Model (`slipstream serve`).

Needs the `server` extra: `pip install 'slipstream[server]'`.
"""

from __future__ import annotations

from .app import create_app
from .run import run_server

__all__ = ["create_app", "run_server"]
