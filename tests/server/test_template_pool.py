"""The chat-template render pool (server/templates.py) on real worker processes: a worker past
its memory or time limit is killed and replaced, renders run side by side, and the load-time
check tells a broken template from a conversation the template refuses."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from slipstream.errors import ChatTemplateLimitExceeded, TokenizerError
from slipstream.modelfile.chat_template import ChatTemplate
pytest.importorskip("fastapi")  # the server package imports it (the GPU machine lacks it)
from slipstream.server.templates import TYPICAL_CONVERSATION, RenderPool, RenderWorkerError  # noqa: E402

from hostile_templates import HOSTILE, MEMORY_WORDS, ask  # tests/server, beside this file

MEMORY = 128 << 20  # a worker maps 37 MB at start; 6 of the namespace's strings pass this
TIME_S = 1.0  # the pool's; the time-limit tests lower it to SHORT_S
SHORT_S = 0.3


@pytest.fixture(scope="module")
def started():
    """A pool of two, started once for the module, and its workers' start times."""
    p = RenderPool(ChatTemplate(HOSTILE), workers=2, memory_limit=MEMORY, time_limit=TIME_S)
    starts = p.wait_ready()
    yield p, starts
    p.close()


@pytest.fixture
def pool(started):
    return started[0]


@pytest.fixture
def short(pool):
    pool.time_limit = SHORT_S
    yield pool
    pool.time_limit = TIME_S


@pytest.mark.parametrize("word", MEMORY_WORDS)
def test_a_worker_past_its_memory_limit_is_replaced(pool, word):
    before, replaced = pool.pids, pool.replaced
    # the message says memory: the allocation failed before the time limit was reached
    with pytest.raises(ChatTemplateLimitExceeded, match="more than its render worker's 128 MiB"):
        pool.render(ask(word))
    after = pool.pids
    assert len(after) == 2 and len(set(before) & set(after)) == 1
    assert pool.replaced == replaced + 1
    for pid in set(before) - set(after):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, not left running
    assert pool.render(ask("hi")) == "<|im_start|>user\nhi<|im_end|>\n"


def test_a_worker_past_its_time_limit_is_killed_and_replaced(short):
    pool = short
    before, replaced = pool.pids, pool.replaced
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateLimitExceeded, match=r"more than 0.3 s .* was killed"):
        pool.render(ask("slow"))
    assert time.monotonic() - t0 < SHORT_S + 0.5
    gone = set(before) - set(pool.pids)
    assert len(gone) == 1 and pool.replaced == replaced + 1
    with pytest.raises(ProcessLookupError):
        os.kill(gone.pop(), 0)
    assert "hi" in pool.render(ask("hi"))


def test_a_worker_killed_from_outside_fails_one_render_and_is_replaced(pool):
    victim = pool.pids[0]
    os.kill(victim, signal.SIGKILL)
    outcomes = []
    for _ in range(2):  # the victim is one of the two idle workers
        try:
            outcomes.append(pool.render(ask("hi")))
        except RenderWorkerError as e:
            outcomes.append(str(e))
    # both idle workers serve in turn (the idle queue is FIFO): the victim fails its render
    assert sum("died (exit status -9)" in o for o in outcomes) == 1
    assert victim not in pool.pids and len(pool.pids) == 2
    assert pool.render(ask("hi")) == pool.render(ask("hi")) == "<|im_start|>user\nhi<|im_end|>\n"


def test_the_templates_own_failure_keeps_its_worker(pool):
    before, replaced = pool.pids, pool.replaced
    with pytest.raises(TokenizerError, match="roles must alternate") as info:
        pool.render(ask("refused"))
    assert not isinstance(info.value, ChatTemplateLimitExceeded)
    assert pool.pids == before and pool.replaced == replaced


def test_renders_run_beside_each_other_and_beside_the_event_loop(short):
    """A slow render holds one worker: another render and the event loop go on meanwhile."""
    async def scenario() -> tuple[float, int]:
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        slow = asyncio.create_task(short.arender(ask("slow")))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        assert "hi" in await short.arender(ask("hi"))
        fast_s = time.monotonic() - t0
        with pytest.raises(ChatTemplateLimitExceeded):
            await slow
        tick.cancel()
        return fast_s, ticks

    fast_s, ticks = asyncio.run(scenario())
    assert fast_s < 0.2  # not behind the slow one's 0.3 s
    assert ticks >= 10  # the loop ran through the slow render's 0.3 s


def test_check_tells_a_broken_template_from_a_refused_conversation(pool):
    assert pool.check() is None  # HOSTILE renders the typical conversation
    gemma_like = ("{% if messages[0]['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}"
                  "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    broken = "{{ messages[0]['content'] + 1 }}"
    for source, verdict in ((gemma_like, None), (broken, "TypeError")):
        one = RenderPool(ChatTemplate(source), workers=1)
        try:
            problem = one.check()
            assert problem is None if verdict is None else verdict in problem
        finally:
            one.close()
    assert [m["role"] for m in TYPICAL_CONVERSATION] == ["system", "user", "assistant", "user"]


def test_workers_start_warm_and_quickly(started):
    """A worker is a fresh interpreter: each start (spawn to a compiled template) took 0.2 s
    on a free core, 0.35 s with two starting at once on two shared cores; a request finds
    one started."""
    pool, starts = started
    assert len(starts) == 2 and all(0 < s < 5.0 for s in starts)
    t0 = time.monotonic()
    pool.render(ask("hi"))
    assert time.monotonic() - t0 < 0.1


def test_close_ends_renders_in_flight_and_waiting():
    """Three slow renders on two workers, from three threads: close() fails the two running
    and the one waiting for a worker at once (a thread left waiting would hold the
    interpreter's exit), and leaves no worker process."""
    one = RenderPool(ChatTemplate(HOSTILE), workers=2, time_limit=30)
    one.wait_ready()
    pids = one.pids
    outcomes: list[BaseException] = []

    def slow() -> None:
        try:
            one.render(ask("slow"))
        except BaseException as e:  # noqa: BLE001  (what it was is the point)
            outcomes.append(e)

    threads = [threading.Thread(target=slow) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    one.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 3 and not any(t.is_alive() for t in threads)
    assert len(outcomes) == 3 and all(isinstance(o, RenderWorkerError) for o in outcomes)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert one.pids == []
