"""`slipstream serve --draft`: requests decode speculatively and answer what plain greedy
decoding answers; /metrics counts the target passes, the tokens they yielded, and the draft's
and the verify passes' time. A real server process with a requantized draft of the default
model, and the worker's plumbing on a fake model."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from server_process import ServerProcess  # noqa: E402

import slipstream  # noqa: E402
from slipstream.quant.requantize import requantize  # noqa: E402
from slipstream.runtime.generate import (Generation, GenerationEvent,  # noqa: E402
                                         GenerationStats)
from slipstream.server import create_app  # noqa: E402

N = 12  # generated tokens per request: the CPU is slow and shared
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors."}]
STORY = "Once upon a time"
COUNTERS = ("slipstream_spec_target_passes_total", "slipstream_spec_tokens_total",
            "slipstream_spec_draft_seconds_total", "slipstream_spec_verify_seconds_total")
# "exact" on both sides: with "fast" CPU weights a tree pass and a decode step round
# differently, enough to flip a near-tie (tests/speculative/test_speculative.py)
LOAD = ("--precision", "exact", "--ctx", "256")


@pytest.fixture(scope="module")
def stack(smollm_path, tmp_path_factory):
    """(server with a Q4_0 draft, plain in-process model, draft path)."""
    draft = requantize(smollm_path, tmp_path_factory.mktemp("serve-spec") / "draft-q4_0.gguf",
                       Q.Q4_0, only=(Q.Q4_1,))
    # fixed small trees: every pass speculates, and a 16-node pass is cheap on a CPU
    server = ServerProcess("-m", str(smollm_path), "--draft", str(draft), *LOAD,
                           "--spec-nodes", "16", "--spec-depth", "4")
    model = None
    try:
        model = slipstream.load(smollm_path, device="cpu", ctx=256, precision="exact")
        server.wait_ready()
        yield server, model, draft
    finally:
        server.stop()
        if model is not None:
            model.close()


@pytest.mark.slow
def test_health_names_the_draft(stack):
    server, _, draft = stack
    assert httpx.get(server.url + "/health").json()["draft"] == draft.name


@pytest.mark.slow
def test_greedy_answers_equal_plain_decoding_and_metrics_count_the_passes(stack):
    server, model, _ = stack
    text = httpx.get(server.url + "/metrics").text
    for name in COUNTERS:  # exported from the start, at zero until a generation speculates
        assert f"{name} 0.0" in text, name
    client = server.client()

    r = client.chat.completions.create(model="default", messages=CHAT, max_tokens=N,
                                       temperature=0)
    want = "".join(e.text for e in model.chat(CHAT, max_tokens=N, temperature=0))
    assert r.choices[0].message.content == want and r.usage.completion_tokens == N
    passes = server.metric("slipstream_spec_target_passes_total")
    tokens = server.metric("slipstream_spec_tokens_total")
    # N - 1 tokens after the prefill's, all from target passes, several per pass
    assert tokens == N - 1 and 0 < passes < tokens, (passes, tokens)
    assert server.metric("slipstream_spec_draft_seconds_total") > 0
    assert server.metric("slipstream_spec_verify_seconds_total") > 0

    stream = client.completions.create(model="default", prompt=STORY, max_tokens=N,
                                       temperature=0, stream=True)
    got = "".join(c.choices[0].text for c in stream)
    assert got == "".join(e.text for e in model.generate(STORY, max_tokens=N, temperature=0))
    assert server.metric("slipstream_spec_tokens_total") == tokens + N - 1
    assert server.metric("slipstream_spec_target_passes_total") > passes


# --- the plumbing, on a fake model (milliseconds) -------------------------------------------------

class FakeTokenizer:
    vocab_size = 100


class FakeSpecModel:
    """Generates "t0 t1 ..."; a prompt starting with id 1 "speculates" (reports spec figures:
    2 tokens per pass), any other decodes plainly. Records generate's keyword arguments."""

    path = Path("fake-model.gguf")
    ctx = 64
    device = "cpu"
    tokenizer = FakeTokenizer()
    draft = None

    def __init__(self):
        self.calls: list[dict] = []

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 99 for c in text] or [1]

    def chat_ids(self, messages) -> list[int]:
        return self.tokenize("".join(m["content"] for m in messages))

    def generate(self, ids, **kw):
        self.calls.append(kw)
        max_tokens = kw["max_tokens"]
        stats = GenerationStats(prompt_tokens=len(ids))
        if ids[0] == 1:
            passes = (max_tokens - 1) // 2
            stats.extra.update(spec_target_passes=passes, spec_tokens_per_pass=2.0,
                               spec_draft_s=0.25, spec_verify_s=0.5)
        return Generation((GenerationEvent(i, f"t{i} ", i,
                                           "length" if i == max_tokens - 1 else None)
                           for i in range(max_tokens)), stats)


def _metrics(client: TestClient) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    return {name: float(line.split()[-1]) for name in COUNTERS for line in lines
            if line.startswith(name + " ")}


def test_worker_passes_the_tree_size_and_counts_only_speculation():
    model = FakeSpecModel()
    with TestClient(create_app(model, spec_nodes=7)) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 5})
        assert r.status_code == 200
        # the server's tree size joins the request's sampling; an unset one is not passed
        assert model.calls[-1]["spec_nodes"] == 7 and "spec_depth" not in model.calls[-1]
        assert model.calls[-1]["max_tokens"] == 5
        assert _metrics(client) == {COUNTERS[0]: 2.0, COUNTERS[1]: 4.0, COUNTERS[2]: 0.25,
                                    COUNTERS[3]: 0.5}
        r = client.post("/v1/completions", json={"prompt": [2, 5], "max_tokens": 5})
        assert r.status_code == 200  # plain decoding: the counters stay
        assert _metrics(client)[COUNTERS[0]] == 2.0
        assert client.get("/health").json()["draft"] is None
    with TestClient(create_app(FakeSpecModel())) as client:  # no sizes: generate's defaults
        client.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 3})
        assert client.app.state.model.calls[-1].keys() == {"max_tokens"}
