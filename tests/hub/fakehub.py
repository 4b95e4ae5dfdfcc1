"""A local server that answers the way the Hugging Face Hub's resolve endpoint does
(HF_ENDPOINT points huggingface_hub at it) and serves plain URLs, and the helpers that run
`python -m slipstream` against it (the fixtures are in conftest.py)."""

from __future__ import annotations

import hashlib
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "alice/tiny-GGUF"
FILE = "tiny-Q8_0.gguf"


@dataclass
class FakeHub:
    """What the server serves and what it saw. `drops` GETs in a row send the headers of the
    whole answer but only `drop_at` bytes of the file, then cut the connection. With
    `stall_at`, GETs send the bytes up to there, set `stalled` and hold the connection open
    until `release` is set (a download in progress, for a test to kill)."""
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo id -> files
    plain: dict[str, bytes] = field(default_factory=dict)  # /files/NAME -> bytes
    drops: int = 0
    drop_at: int = 0
    stall_at: int = 0
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    url: str = ""
    # plain files served as some servers do: no Content-Length, ranges ignored, the end of
    # the body marked by closing the connection; `cut_at` (when set) cuts each such body short
    no_length: set[str] = field(default_factory=set)
    cut_at: int | None = None


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest's output clean
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _error(self, code: int, headers: dict[str, str]):
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _serve(self, body: bool):
            hub.log.append((self.command, self.path, self.headers.get("Range")))
            headers = {}
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path):
                repo, _rev, name = m.groups()
                # the Hub's answers: X-Error-Code tells huggingface_hub which 404 it is
                if repo not in hub.repos:
                    return self._error(404, {"X-Error-Code": "RepoNotFound"})
                headers["X-Repo-Commit"] = COMMIT
                if name not in hub.repos[repo]:
                    return self._error(404, {"X-Error-Code": "EntryNotFound", **headers})
                data = hub.repos[repo][name]
            elif self.path.startswith("/files/") and self.path[7:] in hub.plain:
                data = hub.plain[self.path[7:]]
            else:
                return self._error(404, {})
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            if self.path.startswith("/files/") and self.path[7:] in hub.no_length:
                return self._serve_unsized(data, etag, body)
            headers |= {"ETag": etag, "Accept-Ranges": "bytes"}
            start, status = 0, 200
            rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if_range = self.headers.get("If-Range")
            if rng and (if_range is None or if_range == etag):
                start, status = int(rng.group(1)), 206
                if start >= len(data):
                    return self._error(416, {"Content-Range": f"bytes */{len(data)}"})
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            if hub.stall_at > start:
                self.wfile.write(data[start:hub.stall_at])
                self.wfile.flush()
                hub.stalled.set()
                hub.release.wait(60)
                self.close_connection = True
                return
            if hub.drops > 0:
                hub.drops -= 1
                self.wfile.write(data[start:max(start, hub.drop_at)])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # mid-body: the client sees it
                return
            self.wfile.write(data[start:])

        def _serve_unsized(self, data: bytes, etag: str, body: bool):
            self.send_response(200)
            self.send_header("ETag", etag)
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if body:
                self.wfile.write(data if hub.cut_at is None else data[:hub.cut_at])

    return Handler


def slipstream(env: dict[str, str], *args: str, timeout: int = 120):
    return subprocess.run([sys.executable, "-m", "slipstream", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def one_line_error(r, *needles: str) -> None:
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    for n in needles:
        assert n in r.stderr, r.stderr


def gets(hub: FakeHub) -> list[tuple[str, str | None]]:
    return [(p, rng) for method, p, rng in hub.log if method == "GET"]
