"""Hostile requests against a real `slipstream serve` process: invalid Unicode, bodies
past the size limit (declared or chunked), absurd max_tokens, and clients that leave while their
long prompt is being prefilled. Each is answered with a 4xx in OpenAI's error shape, or stops
its work, and the process keeps serving."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from slipstream.runtime.engine import PREFILL_CHUNK  # noqa: E402
from slipstream.server.limits import DEFAULT_MAX_BODY  # noqa: E402

CTX = 3 * PREFILL_CHUNK  # room for a prompt of three prefill chunks
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
# " hello" is one token: 2.4 chunks' worth, so the prefill has two boundaries to stop at
LONG_PROMPT = "hello" + " hello" * int(2.4 * PREFILL_CHUNK)


# every test here talks to a server process that loads the real model
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--ctx", str(CTX), "--max-queue", "2")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def post_raw(server: ServerProcess, path: str, body: bytes, timeout: float = 60
             ) -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=timeout,
                      headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- invalid Unicode ------------------------------------------------------------------------

# JSON escapes written by hand: an encoder would refuse to produce a lone surrogate
@pytest.mark.parametrize("path,body,param", [
    (CHAT, r'{"messages": [{"role": "user", "content": "hi \ud800 there"}], "max_tokens": 2}',
     "messages.0.content"),
    (CHAT, r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],'
           r' "max_tokens": 2}', "messages.0.content.0.text"),
    (CHAT, r'{"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}',
     "messages.0.name"),
    (COMP, r'{"prompt": "once \ud800 upon", "max_tokens": 2}', "prompt"),
    (COMP, r'{"prompt": ["\udc00"], "max_tokens": 2}', "prompt.0"),
    (COMP, r'{"prompt": "x", "stop": ["\ud800"], "max_tokens": 2}', "stop.0"),
    (COMP, r'{"prompt": "x", "model": "\ud800", "max_tokens": 2}', "model"),
])
def test_lone_surrogate_is_a_400(server, path, body, param):
    err = error_of(post_raw(server, path, body.encode()), 400)
    assert err["param"] == param
    assert "not valid Unicode" in err["message"] and "surrogate" in err["message"]
    assert r"\ud" in err["message"] or r"\udc" in err["message"]  # names the character


def test_surrogate_pair_is_valid_text(server):
    """A pair (an emoji in UTF-16 escapes) is fine: only lone surrogates are refused."""
    r = post_raw(server, COMP, rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_invalid_utf8_bytes_are_a_400(server):
    r = post_raw(server, CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
    error_of(r, 400)


# --- the request-body limit -----------------------------------------------------------------

def _raw_http(server: ServerProcess, head: bytes, body: bytes = b"", timeout: float = 30
              ) -> tuple[int, dict, bytes, float]:
    """Send raw bytes; return (status, headers, body, seconds to the answer)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, f"connection closed before an answer: {data!r}"
            data += chunk
        head_part, rest = data.split(b"\r\n\r\n", 1)
        lines = head_part.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        length = int(headers.get("content-length", 0))
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(lines[0].split()[1]), headers, rest, time.monotonic() - t0


def test_declared_oversized_body_is_refused_before_it_is_sent(server):
    """48 MB announced and never sent: the 413 comes at once (the body is not waited for)."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {48_000_000}\r\n\r\n").encode()
    status, headers, body, seconds = _raw_http(server, head)
    assert status == 413, body
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and str(DEFAULT_MAX_BODY) in err["message"]
    assert "--max-body" in err["message"]
    assert seconds < 5
    assert headers.get("connection") == "close"


def test_chunked_body_past_the_limit_is_refused(server):
    """No Content-Length: the bytes are counted as they arrive and the read stops at the
    limit. The chunks are sent whole, then the answer is read."""
    piece = b"x" * (1 << 20)
    n = DEFAULT_MAX_BODY // len(piece) + 1
    head = (f"POST {COMP} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode()
    body = b"".join(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(n))
    status, _, answer, _ = _raw_http(server, head, body + b"0\r\n\r\n", timeout=60)
    assert status == 413, answer
    assert json.loads(answer)["error"]["code"] == "request_too_large"


def test_body_under_the_limit_is_served(server):
    """A large body under the limit (an ignored field of 3 MiB) is parsed and served."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "user": "u" * (3 << 20)}).encode()
    assert len(body) < DEFAULT_MAX_BODY
    r = post_raw(server, COMP, body)
    assert r.status_code == 200, r.text[:500]


def test_bad_content_length_is_a_400(server):
    head = (f"POST {COMP} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: -5\r\n\r\n").encode()
    status, _, _, _ = _raw_http(server, head)
    assert status == 400  # uvicorn's parser or our middleware; never a 5xx or a hang


def test_too_large_is_counted_in_metrics(server):
    head = (f"POST {COMP} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {DEFAULT_MAX_BODY + 1}"
            f"\r\n\r\n").encode()
    before = server.metric("slipstream_errors_total", 'code="request_too_large"')
    assert _raw_http(server, head)[0] == 413
    assert server.metric("slipstream_errors_total", 'code="request_too_large"') == before + 1


# --- max_tokens -----------------------------------------------------------------------------

@pytest.mark.parametrize("path,field,value", [
    (CHAT, "max_tokens", "9223372036854775808"),  # 2**63
    (CHAT, "max_completion_tokens", "9223372036854775808"),
    (COMP, "max_tokens", "9223372036854775807"),  # 2**63 - 1
    (COMP, "max_tokens", "18446744073709551616"),  # 2**64
    (CHAT, "max_tokens", "1e30"),
    (COMP, "max_tokens", "1e308"),
    (COMP, "max_tokens", "1" + "0" * 5000),  # past Python's int-parsing digit limit
    (CHAT, "max_tokens", "-9223372036854775808"),
    (COMP, "max_tokens", "NaN"),  # Python's json reads it; max_tokens is no float anyway
    (COMP, "max_tokens", "Infinity"),
])
def test_absurd_max_tokens_is_a_400(server, path, field, value):
    head = (r'{"messages": [{"role": "user", "content": "hi"}]' if path == CHAT
            else '{"prompt": "hi"')
    err = error_of(post_raw(server, path, f'{head}, "{field}": {value}}}'.encode()), 400)
    if len(value) < 30 and value.isdigit():  # a valid int above the context
        assert err["param"] == field
        assert f"{CTX} tokens" in err["message"] and "--ctx" in err["message"]


# --- disconnect during a long prefill -------------------------------------------------------

def _wait_idle(server: ServerProcess, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (h := httpx.get(server.url + "/health").json())["running"] or h["queue_depth"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_stops_the_prefill(server, stream):
    """A prompt of 2.4 prefill chunks whose client leaves after a second: the job stops after
    the layer it is at (counted as stage="prefill"), never reaching its first token."""
    _wait_idle(server)
    before = server.metric("slipstream_cancelled_total", 'stage="prefill"')
    prompt_tokens = server.metric("slipstream_prompt_tokens_total")
    generated = server.metric("slipstream_generated_tokens_total")
    body = {"prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        with httpx.stream("POST", server.url + COMP, json=body,
                          timeout=httpx.Timeout(60, read=1.0)) as r:
            for _ in r.iter_lines():
                pass
    deadline = time.monotonic() + 120
    while server.metric("slipstream_cancelled_total", 'stage="prefill"') < before + 1:
        assert time.monotonic() < deadline, "the prefill was not stopped"
        time.sleep(0.1)
    _wait_idle(server)
    assert server.metric("slipstream_generated_tokens_total") == generated  # no token made
    # the cancelled job still counts its prompt as received (Done.prompt_tokens)
    assert server.metric("slipstream_prompt_tokens_total") > prompt_tokens
    r = httpx.post(server.url + COMP, json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_still_serving(server):
    r = server.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert server.alive


@pytest.mark.slow
def test_small_soak_honouring_retry_after(server):
    """benchmarks/serve_soak.py's client in miniature: 8 clients against a wait queue of 2, so some
    requests get 503 + Retry-After and retry after it; every answer must be valid and no 5xx
    other than those 503s."""
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "serve_soak", Path(__file__).resolve().parents[2] / "benchmarks" / "serve_soak.py")
    soak = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = soak  # its dataclasses look their module up there
    spec.loader.exec_module(soak)
    _wait_idle(server)
    clients = [httpx.Client(timeout=120) for _ in range(8)]
    try:
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda i: soak.one(clients[i % 8], server.url, i, 2),
                                     range(32)))
    finally:
        for c in clients:
            c.close()
    assert [o for o in outcomes if o.error] == []
    assert all(o.status == 200 for o in outcomes)
    assert sum(o.retries for o in outcomes) >= 1  # the queue overflowed and was waited out
    assert {o.kind for o in outcomes} == set(soak.KINDS)
