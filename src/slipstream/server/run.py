"""Run the app under uvicorn (what `slipstream serve` calls)."""

from __future__ import annotations

import uvicorn

from .app import create_app


def run_server(model, host: str = "127.0.0.1", port: int = 8080, max_queue: int = 16,
               log_level: str = "info", spec_nodes: int | None = None,
               spec_depth: int | None = None) -> None:
    """Serve `model` until interrupted. Blocks. spec_nodes, spec_depth: see create_app."""
    app = create_app(model, max_queue=max_queue, spec_nodes=spec_nodes, spec_depth=spec_depth)
    # Open streams would hold a graceful shutdown forever; cut them after a few seconds.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=3)
    uvicorn.Server(config).run()
