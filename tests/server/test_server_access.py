"""Admission and shutdown in process, on a fake model (milliseconds): the API key (none, wrong,
right; /health and the chat page open), the Host allow-list, and `end_requests` ending open
streams with an error event and [DONE]. The same against a real `slipstream serve` process, with
the `openai` client and SIGTERM: test_server_admission.py."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from test_worker_unit import FakeModel  # noqa: E402

from slipstream.server import create_app  # noqa: E402
from slipstream.server.access import allowed_hosts, host_name  # noqa: E402

KEY = "sk-local-5f3a"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_api_key_none_wrong_right_and_open_paths():
    app = create_app(FakeModel(), api_key=KEY)
    with TestClient(app) as c:
        for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"prompt": "x"}),
                                   ("GET", "/v1/models", None), ("GET", "/metrics", None)):
            err = error_of(c.request(method, path, json=body), 401)
            assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
            for header in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ", f"Basic {KEY}",
                           KEY):
                r = c.request(method, path, json=body, headers={"Authorization": header})
                err = error_of(r, 401)
                assert r.headers["www-authenticate"] == "Bearer"
                assert err["code"] == "invalid_api_key" and "Incorrect API key" in err["message"]
                assert KEY not in err["message"]  # a refusal never echoes a key
        good = {"Authorization": f"Bearer {KEY}"}
        r = c.post("/v1/chat/completions", json=CHAT, headers=good)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
            "t0 t1 t2 "
        assert c.get("/v1/models", headers={"Authorization": f"bearer  {KEY} "}).status_code \
            == 200  # the scheme is case-insensitive (RFC 9110), spaces around the key ignored
        # open without a key: the health probe and the chat page (whose API calls send it)
        assert c.get("/health").status_code == 200
        page = c.get("/")
        assert page.status_code == 200 and 'id="api-key"' in page.text
        assert "Authorization = `Bearer" in page.text and "r.status === 401" in page.text
        assert c.post("/health").status_code == 401  # only GET/HEAD are open
        metrics = c.get("/metrics", headers=good).text
        assert 'slipstream_errors_total{code="invalid_api_key"} 25.0' in metrics


def test_no_key_configured_needs_none():
    with TestClient(create_app(FakeModel())) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer anything"}).status_code \
            == 200


def test_empty_key_is_refused():
    with pytest.raises(ValueError, match="empty"):
        create_app(FakeModel(), api_key="")


def test_host_allow_list():
    app = create_app(FakeModel(), allowed_hosts=allowed_hosts("127.0.0.1", ["api.example"]))
    with TestClient(app) as c:
        for host in ("127.0.0.1:8080", "localhost", "LOCALHOST:1", "localhost.:80", "[::1]:8080",
                     "[::1]", "api.example", "API.Example:443"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host, path in (("attacker.example", "/v1/models"), ("attacker.example:8080", "/"),
                           ("127.0.0.2", "/health"), ("localhost.attacker.example", "/"),
                           ("api.example.attacker.example", "/v1/models")):
            err = error_of(c.get(path, headers={"Host": host}), 400)
            assert err["code"] == "invalid_host"
            assert repr(host) in err["message"]
            assert f"--allowed-host {host_name(host)}" in err["message"]
        assert 'slipstream_requests_total{endpoint="/v1/models",status="400"} 2.0' in \
            c.get("/metrics", headers={"Host": "localhost"}).text


def test_host_wildcard_bind_and_star():
    """Bound to every interface, any IP literal is answered (it cannot be re-pointed by DNS);
    names still need the list. `*` answers every Host."""
    with TestClient(create_app(FakeModel(), allowed_hosts=allowed_hosts("0.0.0.0"))) as c:
        for host in ("10.1.2.3:8080", "[fe80::1]:80", "localhost"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 400
    with TestClient(create_app(FakeModel(), allowed_hosts=allowed_hosts("127.0.0.1", ["*"]))
                    ) as c:
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 200


def test_host_checked_before_the_key():
    app = create_app(FakeModel(), api_key=KEY, allowed_hosts=allowed_hosts("127.0.0.1"))
    with TestClient(app) as c:
        r = c.get("/v1/models", headers={"Host": "attacker.example",
                                         "Authorization": f"Bearer {KEY}"})
        assert error_of(r, 400)["code"] == "invalid_host"


NAMES = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}",
                      fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(name=NAMES, port=st.one_of(st.none(), st.integers(0, 65535)), upper=st.booleans())
def test_host_name_strips_port_and_case(name, port, upper):
    header = (name.upper() if upper else name) + ("" if port is None else f":{port}")
    assert host_name(header) == name
    assert host_name("[::1]" + ("" if port is None else f":{port}")) == "::1"


class SlowModel(FakeModel):
    """FakeModel at 20 tokens/s: a stream of its 60 tokens is still open 3 s later."""

    def _gen(self, ids, max_tokens, stats):
        for ev in super()._gen(ids, max_tokens, stats):
            threading.Event().wait(0.05)
            yield ev


def _sse(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def test_end_requests_ends_streams_with_an_error_event_and_done():
    """What SIGTERM's grace period ends in: every open stream gets an error event and [DONE]
    (after the tokens it already had), a waiting non-streamed request a 503, a new one too."""
    app = create_app(SlowModel(), max_queue=4)
    with TestClient(app) as c:
        lines: list[str] = []
        got_tokens = threading.Event()
        result: dict = {}

        def stream():
            with c.stream("POST", "/v1/chat/completions",
                          json=dict(CHAT, max_tokens=60, stream=True)) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    lines.append(line)
                    if len(_sse(lines)) >= 4:
                        got_tokens.set()

        def plain():  # queued behind the stream: it never starts
            result["plain"] = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        threads[0].start()
        assert got_tokens.wait(10)
        threads[1].start()
        while app.state.worker.waiting < 1:
            threading.Event().wait(0.01)
        app.state.end_requests()
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        events = _sse(lines)
        assert result["status"] == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens, then the error
        assert error_of(result["plain"], 503)["code"] == "server_shutting_down"
        assert error_of(c.post("/v1/chat/completions", json=CHAT), 503)["code"] == \
            "server_shutting_down"
        assert c.get("/health").status_code == 200  # the probe still answers meanwhile


# --- the command line -------------------------------------------------------------------------

@pytest.fixture()
def served(monkeypatch):
    """`slipstream serve`'s arguments to run_server, without serving."""
    import slipstream.server

    calls: list[dict] = []
    monkeypatch.setattr(slipstream.server, "run_server", lambda **kw: calls.append(kw))
    monkeypatch.delenv("SLIPSTREAM_API_KEY", raising=False)
    return calls


def test_cli_key_from_flag_or_environment(served, monkeypatch, capsys):
    from slipstream.cli import main

    assert main(["serve"]) == 0
    assert served[-1]["api_key"] is None and served[-1]["allowed_host"] == []
    assert served[-1]["shutdown_timeout"] == 10.0
    monkeypatch.setenv("SLIPSTREAM_API_KEY", "from-env")
    assert main(["serve", "--allowed-host", "a.example", "--allowed-host", "*",
                 "--shutdown-timeout", "2.5"]) == 0
    assert served[-1]["api_key"] == "from-env"
    assert served[-1]["allowed_host"] == ["a.example", "*"]
    assert served[-1]["shutdown_timeout"] == 2.5
    assert main(["serve", "--api-key", "from-flag"]) == 0
    assert served[-1]["api_key"] == "from-flag"  # the flag wins
    n = len(served)
    capsys.readouterr()
    for argv, message in ((["serve", "--api-key", " "], "--api-key is empty"),
                          (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout -1.0"),
                          (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout inf")):
        assert main(argv) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert len(served) == n  # refused before serving
