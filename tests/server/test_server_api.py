"""The OpenAI-compatible endpoints of a real `slipstream serve` process, through the official
`openai` client and raw httpx: formats, greedy equality with the Python API, concurrency and
cancellation on disconnect."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from server_process import ServerProcess  # noqa: E402

import slipstream  # noqa: E402

N = 12  # generated tokens per request: small, the CPU is slow and shared
STORY = "Once upon a time"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9,"  # greedy continues it far beyond any max_tokens here
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors."}]


# every test here talks to a server process that loads the real model
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    # Start the server first: it loads the model while this process loads its own copy.
    server = ServerProcess()
    try:
        model = slipstream.load(device="cpu")
        server.wait_ready()
        yield server, model
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(stack) -> ServerProcess:
    return stack[0]


@pytest.fixture(scope="module")
def model(stack):
    return stack[1]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def model_id(model) -> str:
    return model.path.stem


def text_of(events) -> str:
    return "".join(ev.text for ev in events)


def greedy(model, prompt, n: int = N, **kw) -> str:
    return text_of(model.generate(prompt, max_tokens=n, temperature=0, **kw))


def greedy_chat(model, messages, n: int = N, **kw) -> str:
    return text_of(model.chat(messages, max_tokens=n, temperature=0, **kw))


def test_health_and_models(server, client, model_id):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == model_id
    assert [m.id for m in client.models.list().data] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    assert client.models.retrieve("default").id == model_id


def test_completion_matches_python_api(client, model, model_id):
    r = client.completions.create(model=model_id, prompt=STORY, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.model == model_id and len(r.choices) == 1
    assert r.choices[0].text == greedy(model, STORY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(model.tokenize(STORY))
    assert r.usage.completion_tokens == N
    assert r.usage.total_tokens == r.usage.prompt_tokens + N


def test_completion_stream(client, model):
    chunks = list(client.completions.create(model="default", prompt=STORY, max_tokens=N,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *choice_chunks, usage_chunk = chunks
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in choice_chunks) == greedy(model, STORY)
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == N


def test_chat_matches_python_api(client, model, model_id):
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=N,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_chat(model, CHAT)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(model.chat_ids(CHAT))
    local = model.chat(CHAT, max_tokens=N, temperature=0)
    list(local)
    assert r.usage.completion_tokens == local.stats.generated_tokens


def test_chat_stream_chunk_format(client, model):
    chunks = list(client.chat.completions.create(model="default", messages=CHAT, max_tokens=N,
                                                 temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == greedy_chat(model, CHAT)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": STORY}),
])
def test_raw_sse_ends_with_done(server, path, body):
    body = dict(body, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True})
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = raw.strip("\n").split("\n\n")  # one `data:` line per event
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] <= 4
    assert all("usage" in p for p in payloads)  # null until the last, with include_usage


def test_stop_and_penalties_applied_like_the_api(client, model):
    words = greedy(model, STORY).split()
    stop = words[2]
    r = client.completions.create(model="default", prompt=STORY, max_tokens=N, temperature=0,
                                  stop=[stop, "\n\n\n"], user="someone", logprobs=None)
    assert r.choices[0].text == greedy(model, STORY, stop=[stop, "\n\n\n"])
    assert stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    kw = dict(frequency_penalty=1.5, presence_penalty=0.5)
    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=N,
                                       temperature=0, logprobs=None, user="x", **kw)
    assert r.choices[0].message.content == greedy_chat(model, CHAT, **kw)


def test_seeded_sampling_matches_api(client, model):
    r = client.completions.create(model="default", prompt=STORY, max_tokens=8,
                                  temperature=0.9, top_p=0.9, seed=1234)
    local = text_of(model.generate(STORY, max_tokens=8, temperature=0.9, top_p=0.9, seed=1234))
    assert r.choices[0].text == local


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model="default", messages=CHAT, temperature=0,
                                       max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3


def _one_request(server: ServerProcess, i: int, prompt: str) -> str:
    client = server.client()
    if i % 2 == 0:
        msgs = [{"role": "user", "content": prompt}]
        if i % 4 == 0:
            r = client.chat.completions.create(model="default", messages=msgs, max_tokens=8,
                                               temperature=0)
            return r.choices[0].message.content
        stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=8,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream)
    if i % 4 == 1:
        return client.completions.create(model="default", prompt=prompt, max_tokens=8,
                                         temperature=0).choices[0].text
    stream = client.completions.create(model="default", prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True)
    return "".join(c.choices[0].text for c in stream)


def test_eight_concurrent_clients(server, model):
    prompts = [f"Fact number {i} about the sea:" for i in range(8)]
    results: dict[int, str | BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = _one_request(server, i, prompts[i])
        except BaseException as e:  # surfaced by the assertion below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    expected = {i: (greedy_chat(model, [{"role": "user", "content": p}], 8) if i % 2 == 0
                    else greedy(model, p, 8)) for i, p in enumerate(prompts)}
    assert results == expected


def test_disconnect_cancels_generation(server, client):
    before = server.metric("slipstream_cancelled_total", 'stage="running"')
    tokens_before = server.metric("slipstream_generated_tokens_total")
    body = {"prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        got = [line for line in itertools.islice(r.iter_lines(), 12)
               if line.startswith("data: ")]
        assert len(got) >= 3
    # the stream is closed: the server must notice and stop generating
    deadline = time.monotonic() + 60
    while server.metric("slipstream_cancelled_total", 'stage="running"') < before + 1:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.2)
    generated = server.metric("slipstream_generated_tokens_total") - tokens_before
    assert generated < 100  # stopped a few tokens after the disconnect, not at 400
    r = client.completions.create(model="default", prompt=STORY, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    assert server.alive


def test_disconnect_cancels_non_streamed_generation(server, client):
    before = server.metric("slipstream_cancelled_total", 'stage="running"')
    body = {"prompt": COUNTING, "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(2.0))
    deadline = time.monotonic() + 60
    while server.metric("slipstream_cancelled_total", 'stage="running"') < before + 1:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.2)
    r = client.completions.create(model="default", prompt=STORY, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_metrics(server):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("slipstream_requests_total", "slipstream_generated_tokens_total",
                 "slipstream_decode_tokens_per_second", "slipstream_queue_depth",
                 "slipstream_errors_total", "slipstream_time_to_first_token_seconds_bucket"):
        assert name in text
    assert server.metric("slipstream_generated_tokens_total") > 0
    # no draft: the speculative counters are there, and stay at zero
    assert "slipstream_spec_target_passes_total 0.0" in text
    assert "slipstream_spec_tokens_total 0.0" in text
    assert server.metric("slipstream_requests_total",
                         'endpoint="/v1/chat/completions",status="200"') >= 1
