"""Hostile and broken chat templates against a real `slipstream serve` process, on a tiny
synthesized model whose GGUF carries the template: the server's own memory stays flat, a plain
completion is not held behind slow renders, a killed render worker is replaced, and a template
that cannot render a typical conversation is the server's 500, not the client's 400."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import gguf  # noqa: E402
import httpx  # noqa: E402
from hostile_templates import HOSTILE, MEMORY_WORDS  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from slipstream.modelfile.tokenizer import Tokenizer  # noqa: E402
from slipstream.synth import write_synth  # noqa: E402

# every test here starts a server process (3 to 6 s on two shared cores)
pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
RSS_SLACK = 200 << 20  # the server's own RSS may move this much over the hostile requests


def tiny_model(directory: Path, template: str) -> Path:
    return write_synth(directory / "tiny.gguf", "tiny", "Q8_0", n_layers=2, seed=5,
                       chat_template=template)


def chat(server: ServerProcess, word: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + CHAT, timeout=timeout, json={
        "messages": [{"role": "user", "content": word}], "max_tokens": 2, "temperature": 0})


def complete(server: ServerProcess) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": "hello there", "max_tokens": 2, "temperature": 0})


def rss(pid: int) -> int:
    """Resident bytes of one process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`: the server's render workers."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("hostile"), HOSTILE)
    s = ServerProcess("-m", str(path), "--ctx", "256")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_hostile_templates_leave_the_servers_memory_flat(hostile):
    """20 renders that each allocate 1 GB or more (GBs over a loop, without a worker: 12 GB
    after 7 requests) are 400s, and the server process's RSS stays within 200 MB of its
    start; the workers that ran out are replaced."""
    assert chat(hostile, "hi").status_code == 200
    assert complete(hostile).status_code == 200
    start, workers = rss(hostile.proc.pid), children(hostile.proc.pid)
    assert len(workers) == 2
    peak = start
    for i in range(20):
        r = chat(hostile, MEMORY_WORDS[i % len(MEMORY_WORDS)])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "MiB of memory" in err["message"]
        peak = max(peak, rss(hostile.proc.pid))
    assert peak - start < RSS_SLACK, f"the server grew from {start >> 20} to {peak >> 20} MiB"
    after = children(hostile.proc.pid)
    assert len(after) == 2 and not after & workers  # every worker ran out once at least
    assert chat(hostile, "hi").status_code == 200 and hostile.alive


def test_a_plain_completion_is_not_held_behind_slow_templates(hostile):
    """Three chat requests whose template runs until the time limit (6 s; two workers, so the
    third waits for one): a completion, which renders no template, answers meanwhile."""
    answers: list[httpx.Response] = []
    slow = [threading.Thread(target=lambda: answers.append(chat(hostile, "slow")))
            for _ in range(3)]
    for t in slow:
        t.start()
    time.sleep(0.5)  # the renders are under way
    t0 = time.monotonic()
    r = complete(hostile)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert took < 1.0, f"the completion took {took:.1f} s"
    for t in slow:
        t.join(60)
    assert [a.status_code for a in answers] == [400] * 3
    assert all("s in one render" in a.json()["error"]["message"] for a in answers)


def test_a_killed_worker_is_replaced(hostile):
    before = children(hostile.proc.pid)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    codes = []
    for _ in range(3):  # the two workers serve in turn: the victim's request fails
        r = chat(hostile, "hi")
        codes.append(r.status_code)
        if r.status_code != 200:
            err = r.json()["error"]
            assert r.status_code == 500 and err["code"] == "template_worker_failed", r.text
    assert codes.count(500) == 1 and codes.count(200) == 2
    after = children(hostile.proc.pid)
    assert len(after) == 2 and victim not in after


BROKEN = "{{ messages[0]['content'] + 1 }}"  # str + int: no conversation renders


def test_a_template_that_cannot_render_is_a_500_naming_it(tmp_path):
    path = tiny_model(tmp_path, BROKEN)
    s = ServerProcess("-m", str(path), "--ctx", "256")
    try:
        s.wait_ready()
        r = chat(s, "hi")
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "chat_template_error"
        assert f"tokenizer.chat_template in {path.name}" in err["message"]
        assert "TypeError" in err["message"] and "--template-fallback" in err["message"]
        assert complete(s).status_code == 200  # the model itself serves
        lines = [line for line in s.output(None).splitlines() if "chat template" in line]
        assert len(lines) == 1 and "cannot render a typical conversation" in lines[0]
    finally:
        s.stop()


def test_template_fallback_serves_chatml_instead(tmp_path):
    path = tiny_model(tmp_path, BROKEN)
    s = ServerProcess("-m", str(path), "--ctx", "256", "--template-fallback")
    try:
        s.wait_ready()
        r = chat(s, "hi")
        assert r.status_code == 200, r.text
        # the prompt ChatML makes of one user message, tokenized as the server does
        reader = gguf.GGUFReader(path)
        tokenizer = Tokenizer.from_gguf_reader(reader)
        chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(chatml))
        assert "serving ChatML instead (--template-fallback)" in s.output(None)
    finally:
        s.stop()
