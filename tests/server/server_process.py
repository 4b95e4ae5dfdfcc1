"""A real `slipstream serve` process for the server tests, driven over loopback HTTP.

(A helper module, not a conftest: tests/conftest.py already owns the name `conftest`.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

READY_TIMEOUT_S = 240  # loading the default model takes ~15 s on a free core; CI shares them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m slipstream.cli serve ...` on a free port, its output in a temp file."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="slipstream-serve-", suffix=".log",
                                               delete=False)
        cmd = [sys.executable, "-m", "slipstream.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.first_health: tuple[int, dict] | None = None

    def output(self, tail: int | None = 4000) -> str:
        text = Path(self.log.name).read_text(errors="replace")
        return text[-tail:] if tail else text

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Poll /health until it answers 200; `first_health` keeps the first answer of all
        (status code, body): the server listens before its model has loaded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if self.first_health is None:
                    self.first_health = (r.status_code, r.json())
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"the server was not healthy within {timeout} s:\n{self.output()}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def client(self) -> openai.OpenAI:
        # no retries: a 503 must reach the test, not be retried away
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample in /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0
