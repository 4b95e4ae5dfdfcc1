"""Error answers of a real `slipstream serve` process (small context, one-slot queue): each is
a 4xx/503 with OpenAI's error body, and the process keeps serving afterwards."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")
pytest.importorskip("httpx")

import httpx  # noqa: E402
import openai  # noqa: E402
from server_process import ServerProcess  # noqa: E402

CTX = 256
DEFAULT_CAP = 6  # --max-tokens-default: what a request without max_tokens gets
LONG = "hello " * 400  # ~400 tokens: more than CTX


# every test here talks to a server process that loads the real model
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--ctx", str(CTX), "--max-queue", "1", "--max-tokens-default",
                      str(DEFAULT_CAP))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def post(server: ServerProcess, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param=..., code=None,
                 type: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type
    assert err["code"] == code
    if param is not ...:
        assert err["param"] == param
    return err


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param", [
    (COMP, {"prompt": "x", "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSGS, "temperature": -1}, "temperature"),
    (COMP, {"prompt": "x", "temperature": 2.5}, "temperature"),
    (COMP, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMP, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": -3}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (COMP, {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": CTX + 1}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 10**6}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": CTX + 1}, "max_completion_tokens"),
    (COMP, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (COMP, {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    (CHAT, {"messages": MSGS, "presence_penalty": "a lot"}, "presence_penalty"),
    (COMP, {"prompt": "x", "seed": "7"}, "seed"),
    (COMP, {"prompt": "x", "stop": 5}, "stop"),
    (COMP, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (COMP, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMP, {"prompt": "x", "n": 2}, "n"),
    (CHAT, {"messages": MSGS, "n": 2}, "n"),
    (COMP, {"prompt": 42}, "prompt"),
    (COMP, {"prompt": ["a", "b"]}, "prompt"),
    (COMP, {"prompt": [10**9]}, "prompt"),
    (COMP, {}, "prompt"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (CHAT, {"messages": MSGS, "logprobs": True}, "logprobs"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, "tools"),
])
def test_bad_parameters(server, path, body, param):
    assert_error(post(server, path, json=body), 400, param=param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"just a string"', b"null"])
def test_bad_json(server, raw):
    r = post(server, COMP, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, param=None)


def test_form_body_is_explained(server):
    r = post(server, COMP, content=b'{"prompt": "x"}',
             headers={"content-type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in assert_error(r, 400)["message"]


@pytest.mark.parametrize("path,body", [(COMP, {"prompt": "x"}), (CHAT, {"messages": MSGS})])
def test_unknown_model(server, path, body):
    r = post(server, path, json=dict(body, model="gpt-4o", max_tokens=1))
    err = assert_error(r, 404, param="model", code="model_not_found")
    assert "gpt-4o" in err["message"]


def test_unknown_model_through_openai_client(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=1)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4o")


def test_bad_request_through_openai_client(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="default", prompt="x", temperature=-1)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [
    (COMP, {"prompt": LONG}, "prompt"),
    (COMP, {"prompt": list(range(1000, 1000 + CTX))}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}], "stream": True}, "messages"),
])
def test_prompt_longer_than_context(server, path, body, param):
    err = assert_error(post(server, path, json=dict(body, max_tokens=4)), 400, param=param,
                       code="context_length_exceeded")
    assert str(CTX) in err["message"]


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, code="not_found")
    assert_error(httpx.get(server.url + CHAT), 405, code="method_not_allowed")


def _open_stream(server: ServerProcess, client: httpx.Client, max_tokens: int = 200):
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return client.stream("POST", server.url + CHAT, json=body, timeout=120)


def test_queue_full_returns_503_with_retry_after(server):
    running_client, clients = httpx.Client(), [httpx.Client() for _ in range(3)]
    cancelled_before = server.metric("slipstream_cancelled_total", 'stage="waiting"')
    with _open_stream(server, running_client) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        # wait for a content delta: the first request is generating, the wait queue is empty
        while '"content":""' in (line := next(lines)) or not line.startswith("data: {"):
            pass
        # three more at once: one takes the single queue slot, two find the queue full
        results: list = [None] * 3
        opened = []
        lock = threading.Lock()

        def fire(i: int) -> None:
            cm = _open_stream(server, clients[i])
            r = cm.__enter__()
            with lock:
                opened.append(cm)
            results[i] = (r.status_code, dict(r.headers), r.read() if r.status_code != 200
                          else None)

        threads = [threading.Thread(target=fire, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        statuses = sorted(r[0] for r in results)
        assert statuses == [200, 503, 503]
        for status, headers, body in results:
            if status == 503:
                assert int(headers["retry-after"]) >= 1
                r = httpx.Response(503, content=body, headers={"content-type": "application/json"})
                assert_error(r, 503, param=None, code="queue_full", type="server_error")
        health = httpx.get(server.url + "/health").json()
        assert health["queue_depth"] == 1 and health["running"] == 1
        for cm in opened:  # the queued client gives up: it leaves the queue
            cm.__exit__(None, None, None)
    # and the running one disconnected too: the server drains and serves again
    deadline = time.monotonic() + 60
    while (h := httpx.get(server.url + "/health").json())["running"] or h["queue_depth"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    assert server.metric("slipstream_cancelled_total", 'stage="waiting"') == cancelled_before + 1
    assert server.metric("slipstream_errors_total", 'code="queue_full"') >= 2
    for c in [running_client, *clients]:
        c.close()


def test_health_answered_while_loading(server):
    """The server listens before the model loads: its first /health answer said so."""
    status, body = server.first_health
    assert (status, body["status"]) == (503, "loading"), server.first_health


def test_banner(server):
    out = server.output(tail=None)
    for text in ("slipstream serve", "SmolLM2-135M-Instruct.Q4_1.gguf", "cpu", f"{CTX} tokens",
                 f"{DEFAULT_CAP} when a request sets none", f"{server.url}/v1",
                 f"{server.url}/health", "loaded in"):
        assert text in out, out


def test_max_tokens_above_the_context_says_what_fits(server):
    err = assert_error(post(server, CHAT, json={"messages": MSGS, "max_tokens": 10**6}), 400,
                       param="max_tokens")
    assert f"{CTX} tokens" in err["message"] and "--ctx" in err["message"]


def test_a_request_without_max_tokens_gets_the_default_cap(server):
    body = {"messages": [{"role": "user", "content": "Count from one to one hundred."}],
            "temperature": 0}
    r = post(server, CHAT, json=body)
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert usage["completion_tokens"] <= DEFAULT_CAP
    assert choice["finish_reason"] == "stop" or usage["completion_tokens"] == DEFAULT_CAP


def test_still_serving_after_all_errors(server):
    r = server.client().chat.completions.create(model="default", messages=MSGS, max_tokens=2,
                                                temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert server.alive
