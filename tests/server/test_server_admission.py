"""A real `slipstream serve` process on a tiny synthetic model: the API key and the Host check
seen by the `openai` client, SIGTERM in the middle of a stream (the stream ends with [DONE], the
process exits 0), and a load test (50 concurrent streams a round, 10 rounds, flat RSS).

The in-process, millisecond versions of the same checks: test_server_access.py."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from server_process import ServerProcess  # noqa: E402

# every test here starts a server process (~5-10 s on 2 shared cores)
pytestmark = pytest.mark.slow

KEY = "sk-test-3c9d"
# the synthetic model's greedy text never reaches its end-of-text token: a stream of 4000
# tokens runs for seconds (~650 tokens/s on one free core), long past a 1 s grace period
CTX = 4096
LONG = {"prompt": "hello", "max_tokens": 4000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from slipstream.synth import write_synth

    return write_synth(tmp_path_factory.mktemp("admission") / "tiny.gguf", "tiny", "Q8_0",
                       n_layers=2, seed=3)


def started(*args: str) -> ServerProcess:
    s = ServerProcess(*args)
    s.wait_ready()
    return s


def client(server: ServerProcess, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60,
                         **kw)


def test_openai_client_key_and_host(tiny):
    server = started("-m", str(tiny), "--ctx", "256", "--api-key", KEY,
                     "--allowed-host", "api.test")
    try:
        ask = {"model": "default", "max_tokens": 4, "temperature": 0,
               "messages": [{"role": "user", "content": "hi"}]}
        r = client(server, KEY).chat.completions.create(**ask)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        chunks = list(client(server, KEY).chat.completions.create(stream=True, **ask))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert [m.id for m in client(server, KEY).models.list()] == ["tiny"]

        with pytest.raises(openai.AuthenticationError) as e:
            client(server, KEY + "-wrong").chat.completions.create(**ask)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(server, KEY + "-wrong").models.list()
        # no key at all (the openai client always sends one): plain HTTP
        r = httpx.post(server.url + "/v1/chat/completions", json=ask, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "Bearer" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # open
        page = httpx.get(server.url + "/", timeout=30)
        assert page.status_code == 200 and 'id="api-key"' in page.text  # open, asks for it

        # the Host check: what a DNS-rebinding page's requests carry, refused before the key
        with pytest.raises(openai.BadRequestError) as e:
            client(server, KEY, default_headers={"Host": "attacker.example"}
                   ).chat.completions.create(**ask)
        assert e.value.status_code == 400 and e.value.code == "invalid_host"
        assert "'attacker.example'" in e.value.message and "--allowed-host" in e.value.message
        for host in (f"api.test:{server.port}", f"localhost:{server.port}"):
            r = client(server, KEY, default_headers={"Host": host}).chat.completions.create(**ask)
            assert r.usage.completion_tokens == 4
        assert server.alive
    finally:
        server.stop()


def _stream_lines(server: ServerProcess, body: dict, on_line) -> list[str]:
    """The `data:` payloads of a stream read to its end; httpx raises RemoteProtocolError
    if the chunked body ends without its terminator."""
    out: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[len("data: "):])
                on_line(out)
    return out


def _term_after(server: ServerProcess, n_events: int):
    """An on_line callback: SIGTERM the server once the stream has n_events events."""
    sent: dict[str, float] = {}

    def on_line(lines: list[str]) -> None:
        if len(lines) == n_events:
            server.proc.send_signal(signal.SIGTERM)
            sent["at"] = time.monotonic()

    return on_line, sent


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_past_the_grace_period_ends_the_stream_with_an_error_and_done(tiny):
    server = started("-m", str(tiny), "--ctx", str(CTX), "--shutdown-timeout", "1")
    try:
        on_line, sent = _term_after(server, 20)
        lines = _stream_lines(server, LONG, on_line)
        ended = time.monotonic() - sent["at"]
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "server_shutting_down", error
        assert all("choices" in json.loads(x) for x in lines[:-2])
        generated = len(lines) - 2
        assert 20 <= generated < LONG["max_tokens"]  # cut, not finished
        assert 1.0 <= ended < 8.0, ended  # after the grace period, well before uvicorn's cut
        assert server.proc.wait(60) == 0, server.output()
    finally:
        server.stop()


def test_sigterm_lets_a_stream_finish_within_the_grace_period(tiny):
    """A generous grace period: the listening socket closes at once, the open stream runs to
    its natural end ([DONE], no error), and the process exits 0 without waiting out the rest
    of the grace period."""
    server = started("-m", str(tiny), "--ctx", str(CTX), "--shutdown-timeout", "120")
    refused: list[bool] = []
    try:
        def on_line(lines: list[str]) -> None:
            term(lines)
            # half a second after SIGTERM (uvicorn looks every 0.1 s): no new connections
            if "at" in sent and not refused and time.monotonic() - sent["at"] > 0.5:
                refused.append(_refused(server.port))

        term, sent = _term_after(server, 20)
        lines = _stream_lines(server, dict(LONG, max_tokens=3000), on_line)
        assert lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
        assert not any("error" in json.loads(x) for x in lines[:-1])
        assert refused == [True]
        assert server.proc.wait(60) == 0, server.output()
        assert time.monotonic() - sent["at"] < 60  # did not wait out the 120 s
    finally:
        server.stop()


ROUNDS = 10
CLIENTS = 50
RSS_SLACK = 50 << 20  # rounds 2-10 within 50 MiB of round 1 (a leak of 1 KiB a request would
                      # not show; 100 KiB a request, 5 MiB a round, would)


async def _round(url: str) -> list[list[str]]:
    async def one(client: httpx.AsyncClient, i: int) -> list[str]:
        body = {"prompt": f"request {i}", "max_tokens": 8, "temperature": 0.7, "seed": i,
                "stream": True}
        out = []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out.append(line[len("data: "):])
        return out

    limits = httpx.Limits(max_connections=CLIENTS)  # every client at once, each its socket
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        return await asyncio.gather(*(one(client, i) for i in range(CLIENTS)))


def test_load_50_concurrent_streams_flat_rss(tiny):
    server = started("-m", str(tiny), "--ctx", "128", "--max-queue", "64")
    try:
        proc = psutil.Process(server.proc.pid)
        rss = []
        for _ in range(ROUNDS):
            streams = asyncio.run(_round(server.url))
            assert len(streams) == CLIENTS
            for lines in streams:
                assert lines[-1] == "[DONE]"
                assert not any("error" in json.loads(x) for x in lines[:-1])
                assert json.loads(lines[-2])["choices"][0]["finish_reason"] in ("length",
                                                                                 "stop")
            rss.append(proc.memory_info().rss)
        growth = max(rss[1:]) - rss[0]
        assert growth < RSS_SLACK, [f"{r / 2**20:.0f} MiB" for r in rss]
        assert server.metric("slipstream_requests_total",
                             'endpoint="/v1/completions",status="200"') == ROUNDS * CLIENTS
        assert server.alive
    finally:
        server.stop()
