"""Chat templates rendered in a pool of worker processes, each under a memory and a time limit.

A served model's chat template is code from its file. Rendered in the server's own process, a
hostile one grew the server to 12 GB over 7 requests (one-call allocations such as
`' '.center(10**9)` take 1.2 GB each, a list grown in a `namespace` over a loop takes GBs, and
freed memory is not given back), and a 5-second template held the single tokenize thread, so a
plain completion waited 14.8 s. Here each render runs in a worker process
(modelfile/template_worker.py) under RLIMIT_AS; a worker past its memory or time limit is
killed and replaced, so the server's memory stays flat whatever the template does, and N
workers render beside generation and beside each other.

Workers are fresh interpreters started with subprocess (posix_spawn/exec): forking the server,
which holds torch and threads, is unsafe. A start costs about 0.2 s of one core (27 MB); the
pool starts its workers with the model and starts a replacement as soon as one is killed, so a
request finds a warm worker.

`check()` renders a typical conversation once at start: a template that cannot render it is
the model's fault, so its failures are the server's (500), not the client's (400).
"""

from __future__ import annotations

import asyncio
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import ChatTemplateLimitExceeded, SlipstreamError, TokenizerError
from ..modelfile.chat_template import CHATML_TEMPLATE, RENDER_TIMEOUT_S, ChatTemplate
from ..modelfile.template_worker import decode_payload, take_frame, write_frame

WORKERS = 2  # renders at once; each idle worker holds about 27 MB
MEMORY_LIMIT = 512 << 20  # address space of a worker: 37 MB mapped at start, 16M-char output
TIME_LIMIT_S = RENDER_TIMEOUT_S + 1.0  # the sandbox's own deadline first, this kill after it
START_TIMEOUT_S = 60.0  # a worker's start on a loaded CI machine; 0.2 s on a free core

# what check() renders; templates that refuse a system message (Gemma's raise_exception) get
# the same turns without one
TYPICAL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What can you do?"},
    {"role": "assistant", "content": "I can answer questions and help with text."},
    {"role": "user", "content": "Summarise this in one sentence, please."},
]


class RenderWorkerError(SlipstreamError):
    """A render worker could not be started or answered nonsense: the server's fault."""


def _worker_env() -> dict[str, str]:
    """The server's environment, with this slipstream's source first on the path: the worker
    must import the code the server runs, not another installed copy."""
    root = str(Path(__file__).resolve().parents[2])  # .../src above slipstream/server
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class _Worker:
    """One worker process and the frames to and from it."""

    def __init__(self, template: ChatTemplate, memory_limit: int) -> None:
        self.t_start = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.modelfile.template_worker", str(memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=_worker_env())
        self.start_s: float | None = None  # measured by the worker, import to compiled
        self.ready_s: float | None = None  # seen by the parent, spawn to its first frame
        self.ready_reply: dict[str, Any] = {}
        self._buffer = bytearray()
        source = None if template.is_fallback else template.source
        self._send({"source": source, "special_tokens": template.special_tokens})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        write_frame(self.proc.stdin, obj)

    def _read(self, deadline: float) -> Any:
        """The next frame, or TimeoutError past `deadline`, EOFError if the worker is gone."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        # poll, not select: a busy server's descriptors pass select()'s limit of 1024
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            payload = take_frame(self._buffer)
            if payload is not None:
                return decode_payload(payload)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if poller.poll(remaining * 1000):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError
                self._buffer += chunk

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        if self.ready_s is None:
            reply = self._read(time.monotonic() + timeout)
            self.ready_s = time.perf_counter() - self.t_start
            self.start_s = reply.get("ready")
            self.ready_reply = reply
        return self.ready_reply

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
               time_limit: float) -> dict[str, Any]:
        ready = self.wait_ready(START_TIMEOUT_S)
        if "error" in ready:
            return ready
        self._send({"messages": list(messages), "add_generation_prompt": add_generation_prompt})
        return self._read(time.monotonic() + time_limit)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:  # a pipe the dead worker left with unread data
                pass


class RenderPool:
    """`workers` render processes for one template. render() blocks (any thread); arender()
    awaits it without blocking the event loop. A worker past `memory_limit` bytes of address
    space or `time_limit` seconds in one render is killed and replaced at once."""

    def __init__(self, template: ChatTemplate, workers: int = WORKERS,
                 memory_limit: int = MEMORY_LIMIT, time_limit: float = TIME_LIMIT_S) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} is invalid: must be >= 1")
        self.template = template
        self.workers = workers
        self.memory_limit = memory_limit
        self.time_limit = time_limit
        self.replaced = 0  # workers killed and replaced
        # None: a slot whose worker could not be started; the next render there tries again
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="slipstream-template")
        for _ in range(workers):
            try:
                self._idle.put(self._spawn())
            except OSError:  # the first render there tries again, and says why it failed
                self._idle.put(None)

    def _spawn(self) -> _Worker:
        w = _Worker(self.template, self.memory_limit)
        with self._lock:
            self._all.add(w)
        return w

    def _take(self) -> _Worker:
        w = self._idle.get()
        if self._closed:  # woken by close(): wake the next waiter too
            self._idle.put(None)
            raise RenderWorkerError("the chat-template render pool is closed")
        if w is None:
            try:
                w = self._spawn()
            except OSError as e:
                self._idle.put(None)
                raise RenderWorkerError(f"cannot start a chat-template render worker: "
                                        f"{e}") from e
        return w

    def _give_back(self, w: _Worker, keep: bool) -> None:
        """Back to the idle queue; else killed and replaced (started at once, to be warm)."""
        if self._closed:  # close() killed it meanwhile, or will: start none anew
            w.kill()
            return
        if not keep:
            w.kill()
            with self._lock:
                self._all.discard(w)
                self.replaced += 1
            try:
                w = self._spawn()
            except OSError:  # out of processes or memory: the next render tries again
                self._idle.put(None)
                return
        self._idle.put(w)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> list[float]:
        """Wait until every idle worker has started; their start times in seconds, as seen
        from here (spawn to compiled template)."""
        workers = [self._take() for _ in range(self.workers)]
        try:
            for w in workers:
                w.wait_ready(timeout)
            return [w.ready_s or 0.0 for w in workers]
        finally:
            for w in workers:
                self._idle.put(w)

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return sorted(w.pid for w in self._all)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
               ) -> str:
        """The prompt text; ChatTemplateLimitExceeded past a bound (the sandbox's, the memory
        limit, the time limit), TokenizerError for the template's own failure,
        RenderWorkerError when no worker could render at all."""
        if self._closed:
            raise RenderWorkerError("the chat-template render pool is closed")
        w = self._take()
        keep = False
        try:
            reply = w.render(messages, add_generation_prompt, self.time_limit)
            keep = reply.get("error") != "memory"  # the worker exits after a MemoryError
        except TimeoutError:
            raise ChatTemplateLimitExceeded(
                f"the chat template ran for more than {self.time_limit:g} s in one render "
                f"(its worker process was killed)") from None
        except (EOFError, OSError, ValueError) as e:  # ValueError: a frame that is not JSON
            if self._closed:
                raise RenderWorkerError("the chat-template render pool was closed (the "
                                        "server is stopping)") from None
            raise RenderWorkerError(f"the chat-template render worker died (exit status "
                                    f"{w.proc.poll()}) or answered garbage "
                                    f"({type(e).__name__})") from None
        finally:
            self._give_back(w, keep)
        return _result(reply, self.memory_limit)

    async def arender(self, messages: Sequence[dict[str, Any]],
                      add_generation_prompt: bool = True) -> str:
        """render(), on one of the pool's threads: the event loop goes on meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, partial(
            self.render, messages, add_generation_prompt))

    def check(self) -> str | None:
        """None when the template renders a typical conversation (or the same without its
        system message); else why not, in a few words."""
        try:
            self.render(TYPICAL_CONVERSATION)
            return None
        except TokenizerError as e:
            first = str(e)
        try:
            self.render(TYPICAL_CONVERSATION[1:])
            return None
        except TokenizerError:
            return first

    def close(self) -> None:
        """Kill every worker; renders in flight or waiting fail with RenderWorkerError (a
        waiting thread left blocked would hold the interpreter's exit, which joins it)."""
        self._closed = True
        self._idle.put(None)
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()


def _result(reply: dict[str, Any], memory_limit: int) -> str:
    if "text" in reply:
        return reply["text"]
    kind, message = reply.get("error"), reply.get("message", "")
    if kind == "memory":
        raise ChatTemplateLimitExceeded(
            f"the chat template allocated more than its render worker's {memory_limit >> 20} "
            f"MiB of memory (its worker process was replaced)")
    if kind == "limit":
        raise ChatTemplateLimitExceeded(message)
    if kind == "render":
        raise TokenizerError(message)
    raise RenderWorkerError(f"the chat-template render worker answered {reply!r:.200}")


@dataclass
class ServedTemplate:
    """The pool rendering a served model's chat template, and what the check at start found:
    `problem` says why the file's template cannot render a typical conversation (None: it
    can, or --template-fallback replaced it, `fallback` True)."""

    pool: RenderPool
    model_file: str
    problem: str | None = None
    fallback: bool = False

    @classmethod
    def start(cls, template: ChatTemplate, model_file: str, fallback: bool = False,
              report: Callable[[str], None] | None = None, **pool_kwargs: Any
              ) -> ServedTemplate:
        """Start the pool and check the template; a broken one is reported in one line."""
        report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        pool = RenderPool(template, **pool_kwargs)
        problem = pool.check()
        if problem is None:
            return cls(pool, model_file)
        what = (f"the chat template of {model_file} cannot render a typical conversation "
                f"(system, user, assistant, user): {problem}")
        if not fallback:
            report(f"warning: {what}; its chat requests will get a 500 (--template-fallback "
                   f"serves ChatML instead)")
            return cls(pool, model_file, problem)
        pool.close()
        report(f"warning: {what}; serving ChatML instead (--template-fallback)")
        return cls(RenderPool(fallback_template(template), **pool_kwargs), model_file,
                   fallback=True)

    def close(self) -> None:
        self.pool.close()


def fallback_template(template: ChatTemplate) -> ChatTemplate:
    """Plain ChatML with the model's special tokens: what --template-fallback serves instead
    of a template that cannot render a typical conversation."""
    return ChatTemplate(CHATML_TEMPLATE, **template.special_tokens)


__all__ = ["MEMORY_LIMIT", "TIME_LIMIT_S", "TYPICAL_CONVERSATION", "WORKERS", "RenderPool",
           "RenderWorkerError", "ServedTemplate", "fallback_template"]
