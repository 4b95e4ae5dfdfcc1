"""Who decides when a command stops: Ctrl-C while a generation streams, and the ranks of a
--distributed run.

Ctrl-C: in `chat`, the first press during a reply stops it at the next token and returns to the
prompt (the partial reply stays in the conversation); at an idle prompt it says how to quit, and
a second one quits. In `run`, it stops the generation, prints the summary and exits 130. A second
press while a generation is still stopping interrupts at once.

A press during the prompt's prefill stops it after the layer being computed
(Engine.between_layers), not at the end of the prefill: a layer of a long prompt takes a
fraction of a second on the CPU, the whole prefill half a minute resident and more streamed.

--distributed: every rank loads its own stage; rank 0 runs the command and prints, the others
compute their stage of rank 0's passes until it stops.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

from .render import err


class PrefillStopped(Exception):
    """Ctrl-C was pressed during a prefill: raised between its layers, caught by `stream`."""


class CtrlC:
    """While a generation streams: the first Ctrl-C sets `pressed` (the loop stops at the next
    token and closes the generation, which leaves the model as any finished generation does;
    a prefill of `engine` stops after its current layer); a second one raises
    KeyboardInterrupt at once (a slow streamed token). Outside the main thread (an embedding
    caller) signals stay as they are."""

    def __init__(self, engine=None) -> None:
        self.pressed = False
        self._installed = False
        self._previous = None
        self._engine = engine if hasattr(engine, "between_layers") else None
        self._previous_check = None

    def _stop_prefill(self) -> None:
        if self.pressed:
            raise PrefillStopped

    def _handler(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
            if self._engine is not None:
                self._previous_check = self._engine.between_layers
                self._engine.between_layers = self._stop_prefill
        return self

    def __exit__(self, *exc) -> None:
        if self._installed and self._engine is not None:
            self._engine.between_layers = self._previous_check
        if self._installed:
            # None: a handler installed outside Python; the default is the nearest
            signal.signal(signal.SIGINT, self._previous if self._previous is not None
                          else signal.default_int_handler)


def stream(events, reply: list[str] | None = None, engine=None) -> bool:
    """Write the events' text to stdout as it comes (and to `reply`); True when Ctrl-C stopped
    the generation before it finished (in `engine`'s prefill: after its current layer). A
    second Ctrl-C raises KeyboardInterrupt."""
    with CtrlC(engine) as ctrl_c:
        try:
            for ev in events:
                if ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    if reply is not None:
                        reply.append(ev.text)
                if ctrl_c.pressed:
                    break
        except PrefillStopped:
            pass  # nothing generated yet; the next generation resets the cache
        finally:
            events.close()  # ends prefill/decode where the loop left it early
    return ctrl_c.pressed


def exit_at_once(code: int) -> NoReturn:
    """End the process now, skipping the interpreter's teardown: after a Ctrl-C the user is
    waiting, and unloading torch alone takes 0.3-1.5 s (1.3 s measured on a busy 2-core
    machine, against 0.05 s without the teardown). By the time a command returns, nothing
    else is pending: image files are fsynced as they are written, downloads resume from their
    partial file, a trace is written before the command returns; stdout, stderr and logging
    are flushed here."""
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # closed (a pipe's reader gone): nothing to keep
            pass
    os._exit(code)


def follow_rank0(model) -> None:
    """--distributed, after the load. On the ranks after the first: compute this stage of rank
    0's passes until it stops, then exit. On rank 0: stop the other ranks however the command
    ends, and print the stages."""
    if not model.engine.pipeline.first:
        try:
            model.serve()
        finally:
            model.close()
        raise SystemExit(0)
    from ..runtime.pipeline import stage_table  # torch: not for the commands that load none

    atexit.register(model.engine.stop)
    err.print(stage_table(model.pipeline_stages))
