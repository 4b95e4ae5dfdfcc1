"""Fixtures of the hub tests: a synthesized GGUF, the local Hub-like server, and an
environment whose cache and Hub endpoint are the test's own."""

from __future__ import annotations

import os
import subprocess
import threading
from http.server import ThreadingHTTPServer

import pytest
from fakehub import FILE, REPO, FakeHub, _handler

from slipstream.synth import write_synth


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = write_synth(tmp_path_factory.mktemp("gguf") / FILE, "tiny", "Q8_0", n_layers=1)
    return path.read_bytes()


@pytest.fixture
def hub(gguf_bytes):
    h = FakeHub(repos={REPO: {FILE: gguf_bytes, "sub/other.gguf": gguf_bytes,
                               "README.md": b"# not a model\n"}},
                plain={FILE: gguf_bytes, "page.gguf": b"<!DOCTYPE html><html></html>"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(h))
    # shutdown() waits for serve_forever's next poll: 0.5 s by default, at every test's end
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                     daemon=True).start()
    h.url = f"http://127.0.0.1:{server.server_port}"
    yield h
    server.shutdown()
    server.server_close()


@pytest.fixture
def env(tmp_path, hub) -> dict[str, str]:
    """The Hub is the local server; the caches are the test's own; no token; online."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("HF_") and k != "SLIPSTREAM_CACHE"}
    return e | {"SLIPSTREAM_CACHE": str(tmp_path / "cache"), "HF_ENDPOINT": hub.url,
                "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture
def cli_in_process(env, monkeypatch, capsys):
    """`slipstream ARGS` run in this process with `env` (no interpreter start: about 1 s
    less a call here), returning what a subprocess.run of it would: the exit status, stdout
    and stderr."""
    from slipstream import cli

    for k in list(os.environ):
        if k.startswith("HF_") or k == "SLIPSTREAM_CACHE":
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        rc = cli.main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), rc, out.out, out.err)

    return run
