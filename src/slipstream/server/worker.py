"""One generation thread for the one model, fed by a bounded FIFO queue.

A Model holds one KV cache, so requests take turns. The event loop never runs the model: it
submits a `Job` and awaits what the worker thread pushes into the job's asyncio queue with
`loop.call_soon_threadsafe`. A job cancelled while waiting leaves the queue at once; a job
cancelled while running stops at the next token (the generator is closed, which ends the
decode loop), or, while its prompt is prefilled, after the layer it is computing
(`prefill_guard`): a long prompt whose client has gone no longer holds the model until its
whole prompt has been read.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import SlipstreamError
from ..runtime.generate import GenerationEvent

log = logging.getLogger("slipstream.server")


class QueueFull(Exception):
    """The wait queue holds max_queue jobs already."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are already waiting for the model")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


class Cancelled(Exception):
    """Raised inside a prefill to stop it: the job was cancelled between two chunks."""


@dataclass
class Done:
    """The last item of a job: token counts and timings of the generation."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cancelled: bool = False
    cancelled_in_prefill: bool = False  # stopped before its first token
    # the generation's GenerationStats.extra: speculative decoding's figures when it ran
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _on_cancel: Callable[[Job], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Safe from any thread, any number of times, also after the job finished."""
        if not self._cancel.is_set():
            self._cancel.set()
            if self._on_cancel is not None:
                self._on_cancel(self)

    def push(self, item: GenerationEvent | Done | BaseException) -> None:
        """Called by the worker thread: hand an item to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown); nobody is listening
            self.cancel()

    async def events(self) -> AsyncIterator[GenerationEvent | Done]:
        """The job's events, then its Done; re-raises an error the generation raised."""
        while True:
            item = await self.items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Done):
                return


class GenerationWorker:
    """Runs jobs one at a time, first come first served, on a dedicated thread."""

    def __init__(self, model, max_queue: int = 16, on_done: Callable[[Done], None] | None = None,
                 on_cancel: Callable[[str], None] | None = None,
                 generate_kwargs: dict[str, Any] | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} is invalid: must be >= 0")
        self.model = model
        self.max_queue = max_queue
        # the server's own arguments to every Model.generate (speculative tree sizes), past
        # what the request chose; those left None are not passed, so generate's defaults hold
        self.generate_kwargs = {k: v for k, v in (generate_kwargs or {}).items()
                                if v is not None}
        self.on_done = on_done  # called on the worker thread after each generation
        # called with the stage the job was cancelled in: "waiting", "prefill" (before its
        # first token) or "running"
        self.on_cancel = on_cancel
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._recent_s: deque[float] = deque(maxlen=16)  # durations, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="slipstream-generate",
                                        daemon=True)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            jobs = list(self._waiting) + ([self._running] if self._running else [])
            self._cv.notify_all()
        for job in jobs:
            job.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, prompt_ids: Sequence[int], kwargs: dict[str, Any]) -> Job:
        """Queue a generation (call from the event loop). Raises QueueFull."""
        job = Job(list(prompt_ids), dict(kwargs), asyncio.get_running_loop())
        job._on_cancel = self._cancelled
        with self._cv:
            if len(self._waiting) >= self.max_queue and (self._running or self._waiting):
                raise QueueFull(len(self._waiting), self._retry_after())
            self._waiting.append(job)
            self._cv.notify()
        return job

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: the mean recent job time times the line."""
        mean = sum(self._recent_s) / len(self._recent_s) if self._recent_s else 5.0
        return max(1, min(120, round(mean * (len(self._waiting) + 1))))

    def _cancelled(self, job: Job) -> None:
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (the loop notices) or already finished
        job.push(Done(len(job.prompt_ids), 0, None, cancelled=True))
        if self.on_cancel is not None:
            self.on_cancel("waiting")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._running = self._waiting.popleft()
            t0 = time.perf_counter()
            try:
                self._run(job)
            except Exception as e:  # report every failure to its request; keep serving
                if not isinstance(e, SlipstreamError):
                    log.exception("generation failed")
                job.push(e)
            finally:
                with self._cv:
                    self._running = None
                self._recent_s.append(time.perf_counter() - t0)

    def _run(self, job: Job) -> None:
        n = 0
        finish = None
        in_prefill = False
        with prefill_guard(getattr(self.model, "engine", None), lambda: job.cancelled):
            gen = self.model.generate(job.prompt_ids, **job.kwargs, **self.generate_kwargs)
            try:
                for ev in gen:
                    n += 1
                    finish = ev.finish_reason
                    job.push(ev)
                    if job.cancelled:
                        break
            except Cancelled:
                in_prefill = True
            finally:
                gen.close()  # stops the decode loop when we left it early
        stats = gen.stats
        done = Done(len(job.prompt_ids), n, finish, stats.prefill_s if stats else 0.0,
                    stats.decode_s if stats else 0.0, cancelled=job.cancelled and finish is None,
                    cancelled_in_prefill=in_prefill, extra=dict(stats.extra) if stats else {})
        if done.cancelled and self.on_cancel is not None:
            self.on_cancel("prefill" if in_prefill else "running")
        if self.on_done is not None:
            self.on_done(done)
        job.push(done)


@contextmanager
def prefill_guard(engine, cancelled: Callable[[], bool]) -> Iterator[None]:
    """While the block runs, a prompt's prefill raises Cancelled after the layer (or before
    the chunk) it is at once `cancelled()` is true: the engine's between_layers hook, which
    the CLI's Ctrl-C uses too. Decode steps and passes with a step never call it. The worker
    thread is the only caller of the model while the block runs."""
    if engine is None or not hasattr(engine, "between_layers"):  # a fake model in unit tests
        yield
        return

    def check() -> None:
        if cancelled():
            raise Cancelled()

    previous = engine.between_layers
    engine.between_layers = check
    try:
        yield
    finally:
        engine.between_layers = previous
