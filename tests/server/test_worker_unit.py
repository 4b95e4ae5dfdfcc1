"""The generation worker and the app's error paths on a fake model (no weights, milliseconds):
FIFO order, the queue bound, cancellation of waiting and running jobs, and an error raised in
the middle of a stream."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from slipstream.errors import SlipstreamError  # noqa: E402
from slipstream.runtime.generate import (Generation, GenerationEvent,  # noqa: E402
                                         GenerationStats)
from slipstream.server import create_app  # noqa: E402
from slipstream.server.worker import Done, GenerationWorker, QueueFull  # noqa: E402


class FakeTokenizer:
    vocab_size = 100


class FakeModel:
    """Generates "t0 t1 ..." forever (until max_tokens); a prompt with id 99 fails at token 2.
    `gate` can hold each generation at its start, so tests control who runs when."""

    path = Path("fake-model.gguf")
    ctx = 64
    device = "cpu"
    tokenizer = FakeTokenizer()

    def __init__(self):
        self.started: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.produced = 0

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 99 for c in text] or [1]

    def chat_ids(self, messages) -> list[int]:
        return self.tokenize("".join(m["content"] for m in messages))

    def generate(self, ids, max_tokens=16, **kw):
        stats = GenerationStats(prompt_tokens=len(ids))
        self.started.append(list(ids))
        return Generation(self._gen(list(ids), max_tokens, stats), stats)

    def _gen(self, ids, max_tokens, stats):
        self.gate.wait(10)
        for i in range(max_tokens):
            if 99 in ids and i == 2:
                raise SlipstreamError("the fake model broke")
            time.sleep(0.005)
            self.produced += 1
            stats.generated_tokens = i + 1
            yield GenerationEvent(i, f"t{i} ", i, "length" if i == max_tokens - 1 else None)


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_fifo_bound_and_cancellation():
    async def scenario():
        model = FakeModel()
        cancels: list[str] = []
        worker = GenerationWorker(model, max_queue=2, on_cancel=cancels.append)
        worker.start()
        try:
            model.gate.clear()
            first = worker.submit([1], {"max_tokens": 3})
            await asyncio.to_thread(_wait, lambda: worker.busy and not worker.waiting)
            second = worker.submit([2], {"max_tokens": 3})
            third = worker.submit([3], {"max_tokens": 3})
            with pytest.raises(QueueFull) as e:
                worker.submit([4], {"max_tokens": 3})
            assert e.value.retry_after_s >= 1
            second.cancel()  # leaves the queue at once
            assert worker.waiting == 1 and cancels == ["waiting"]
            model.gate.set()
            outs = []
            for job in (first, second, third):
                outs.append([item async for item in job.events()])
            assert "".join(ev.text for ev in outs[0][:-1]) == "t0 t1 t2 "
            assert outs[1] == [Done(1, 0, None, cancelled=True)]
            assert outs[2][-1].completion_tokens == 3
            assert model.started == [[1], [3]]  # first come, first served; [2] never ran

            running = worker.submit([5], {"max_tokens": 10_000})
            async for item in running.events():
                if isinstance(item, GenerationEvent) and item.index == 3:
                    produced_at_cancel = model.produced
                    running.cancel()
                if isinstance(item, Done):
                    assert item.cancelled
            assert model.produced - produced_at_cancel <= 1  # stopped at the next token
            assert cancels == ["waiting", "running"]
        finally:
            worker.stop()

    asyncio.run(scenario())


@pytest.fixture()
def client():
    with TestClient(create_app(FakeModel(), max_queue=4)) as c:
        yield c


def test_error_in_the_middle_of_a_stream(client):
    body = {"prompt": [5, 99], "max_tokens": 8, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "the fake model broke" in events[-2]
    assert events[0].startswith('data: {"id":"cmpl-')


def test_error_in_a_non_streamed_request(client):
    r = client.post("/v1/completions", json={"prompt": [5, 99], "max_tokens": 8})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    r = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0 t1 "


def test_default_max_tokens(client):
    r = client.post("/v1/completions", json={"prompt": "x"})  # OpenAI's default: 16
    assert r.json()["usage"]["completion_tokens"] == 16
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    # the default cap (512) is more than the context: chat asks for the whole context (the
    # real runtime caps it at what the prompt leaves)
    assert r.json()["usage"]["completion_tokens"] == FakeModel.ctx
    assert client.get("/health").json()["max_tokens_default"] == FakeModel.ctx


CHAT_X = {"messages": [{"role": "user", "content": "x"}]}


def test_the_default_cap_is_the_servers_choice():
    with TestClient(create_app(FakeModel(), max_tokens_default=10)) as c:
        r = c.post("/v1/chat/completions", json=CHAT_X)
        assert r.json()["usage"]["completion_tokens"] == 10
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/completions", json={"prompt": "x"})  # fewer than OpenAI's 16
        assert r.json()["usage"]["completion_tokens"] == 10
        r = c.post("/v1/chat/completions", json=dict(CHAT_X, max_tokens=12))  # asked: honoured
        assert r.json()["usage"]["completion_tokens"] == 12
    with pytest.raises(ValueError, match="max_tokens_default=0"):
        create_app(FakeModel(), max_tokens_default=0)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", dict(CHAT_X, max_tokens=FakeModel.ctx + 1), "max_tokens"),
    ("/v1/chat/completions", dict(CHAT_X, max_completion_tokens=10**9),
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6, "stream": True}, "max_tokens"),
])
def test_max_tokens_above_the_context_is_a_400(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert f"{FakeModel.ctx} tokens" in err["message"] and "--ctx" in err["message"]
    # the context itself is allowed (the runtime stops where the prompt leaves no room)
    body = dict(body, **{param: FakeModel.ctx})
    assert client.post(path, json=body).status_code == 200


class RunawayTemplateModel(FakeModel):
    """A model whose chat template (from its file) loops: range(10**12) once gave a 500
    internal_error; it is the model's fault, a 500 chat_template_error naming the bound."""

    def __init__(self):
        super().__init__()
        from slipstream.modelfile.chat_template import ChatTemplate

        self.template = ChatTemplate("{% for i in range(10**12) %}x{% endfor %}")

    def prompt_ids(self, text: str) -> list[int]:  # the server renders, as for Model
        return self.tokenize(text)


def test_a_runaway_chat_template_is_a_500_naming_the_bound():
    with TestClient(create_app(RunawayTemplateModel())) as c:
        r = c.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "chat_template_error"
        assert "range(1000000000000): more than 100,000 items" in err["message"]
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200  # and the server goes on serving


def test_loading_then_ready():
    """An app made before its model answers /health 503 "loading", the API 503 with
    Retry-After, and serves once the model is attached."""
    app = create_app(None, max_queue=4)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        for method, path, body in (("POST", "/v1/chat/completions", CHAT_X),
                                   ("POST", "/v1/completions", {"prompt": "x"}),
                                   ("GET", "/v1/models", None)):
            r = c.request(method, path, json=body)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "model_loading"
        assert c.get("/metrics").status_code == 200
        app.state.attach(FakeModel())
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["model"] == "fake-model"
        r = c.post("/v1/chat/completions", json=dict(CHAT_X, max_tokens=3))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
            "t0 t1 t2 "
        with pytest.raises(RuntimeError, match="already serves"):
            app.state.attach(FakeModel())


def test_prefill_guard_stops_a_prefill_after_the_current_layer(tmp_path):
    """Through the engine's between_layers hook: a guard that is not cancelled leaves the
    logits the unguarded call's bits and decode steps alone; a cancellation stops the prefill
    after the layer it comes in, with Cancelled; the hook is the engine's own again after."""
    import torch

    import slipstream
    from slipstream.server.worker import Cancelled, prefill_guard
    from slipstream.synth import write_synth

    path = write_synth(tmp_path / "tiny.gguf", "tiny", "Q8_0", n_layers=4, seed=3)
    with slipstream.load(path, device="cpu", ctx=64) as model:
        ids = torch.randint(0, model.config.vocab_size, (40,)).tolist()
        engine = model.engine
        engine.reset()
        plain = engine.forward(ids)
        done = []
        engine.layer_hook = lambda i, x, y: done.append(i)
        try:
            engine.reset()
            with prefill_guard(engine, lambda: False):
                guarded = engine.forward(ids)
            assert torch.equal(plain, guarded)
            engine.reset()
            with prefill_guard(engine, lambda: True):
                engine.forward(ids[:1])  # a decode-sized pass: never checked
            done.clear()
            engine.reset()
            with prefill_guard(engine, lambda: len(done) >= 2):  # cancelled during layer 1
                with pytest.raises(Cancelled):
                    engine.forward(ids)
            assert done == [0, 1] and engine.length == 0
        finally:
            engine.layer_hook = None
        assert engine.between_layers is None
