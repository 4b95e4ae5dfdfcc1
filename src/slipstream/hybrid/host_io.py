"""The hand-off between the GPU and the CPU's shares of hybrid decode: `HostIO` holds the pinned
buffers, the events and the worker thread that the split layers' shares (hybrid.share.HostFFN)
go through, and orders them on the CUDA stream.

On CUDA the host does not wait for a share (run-ahead): the worker computes it while the main
thread goes on enqueueing the next layers, and a kernel on the stream waits for the worker's
counter in pinned memory and adds the result (kernels.wait_host_add, the wait kernels of
kernels/host_wait.py), so the GPU runs the next layers as soon as the CPU's result lands.
"""

from __future__ import annotations

import collections
import faulthandler
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import envs, kernels, native

# The worker needs Python's GIL between its native calls while the main thread holds it to
# enqueue CUDA work (Triton's launches release it rarely); a waiting thread gets it only once
# the holder lets go or the switch interval passes (5 ms by default), and the worker's OpenMP
# team idles meanwhile. So the worker lowers the interval, process-wide and never raising it,
# to SLIPSTREAM_GIL_SWITCH_S (0.1 ms; 0 leaves it alone). On the 2-core CI machine, with a
# thread beside it that never lets go, an 8B's share took a median 18.8 ms at 5 ms (35 ms as
# four calls rather than one fused) and 3.2-3.6 ms at 0.1 ms, against 2.4-5.4 with that thread
# idle.


class CpuShareError(RuntimeError):
    """The CPU's share of hybrid decode went wrong on the worker thread: its own exception
    (chained, its traceback in the message), or a GPU wait that gave up on it."""


@dataclass(frozen=True)
class JobTimes:
    """Where one CPU share's time went on the worker (run-ahead), for the message of a GPU
    wait that gave up: from its hand-off to the worker's start on it (queued behind earlier
    shares), then waiting for its input's copy down (a CUDA event on the stream), computing."""

    layer: int
    seq: int
    queued_s: float
    input_s: float
    compute_s: float

    @property
    def own_s(self) -> float:
        """The worker's time on the share alone: what the GPU's wait for it lasts at most
        beyond the wait for the share before it (queued time is that share's)."""
        return self.input_s + self.compute_s

    def describe(self) -> str:
        return (f"layer {self.layer}'s share (job {self.seq}) took {self.own_s:.3g} s: "
                f"{self.input_s:.3g} s waiting for its input's copy down, "
                f"{self.compute_s:.3g} s computing (after {self.queued_s:.3g} s queued)")


class EventPool:
    """The CUDA events that mark each share's input copied down, reused rather than made and
    dropped per share: a share's event goes back to the pool once the worker is done with
    it, so that no event is ever destroyed on the worker thread. The GPU may be spinning on
    the worker (the wait for its next share) at any time, and a thread the GPU waits on must
    make no CUDA call that can wait for the GPU: cudaEventDestroy can (PyTorch's NCCL
    watchdog got stuck in it behind hung kernels, and torch releases the GIL around it for
    that reason); cudaEventQuery, the one call the worker makes, does not. With an event
    made per share, the worker held the last reference to every share's event but the last
    and destroyed it as it unpacked the next share, the GPU already waiting for that one."""

    def __init__(self, make: Callable[[], object] = torch.cuda.Event):
        self._make = make
        self._free: collections.deque = collections.deque()  # append/pop: atomic in CPython
        self.made = 0

    def take(self) -> object:
        """An event no share in flight uses (made on the calling thread if none is free)."""
        try:
            return self._free.pop()
        except IndexError:
            self.made += 1
            return self._make()

    def give(self, event: object) -> None:
        """`event`'s share is done with it (the worker, or the host's own wait)."""
        self._free.append(event)


@dataclass
class HostStats:
    """What the CPU's shares cost: seconds the CPU spent computing them (from the input's
    arrival to the result's hand-back) and bytes of packed weights read (a layer store hands
    HostIO its own StoreStats, which has the same fields)."""

    cpu_s: float = 0.0
    cpu_bytes: int = 0


class Scratch:
    """Float32 buffers reused from call to call by one thread (hybrid's CPU worker): buffer k
    as an (m, n) view, grown when a call needs more."""

    def __init__(self) -> None:
        self._flat: dict[int, torch.Tensor] = {}

    def get(self, k: int, m: int, n: int) -> torch.Tensor:
        flat = self._flat.get(k)
        if flat is None or flat.numel() < m * n:
            flat = self._flat[k] = torch.empty(m * n)
        return flat[:m * n].view(m, n)


@dataclass
class HostIO:
    """The buffers, events and worker the CPU's shares of one model's split layers go through.

    On CUDA the host does not wait for the CPU's share (run-ahead): `finish` hands the layer to
    a worker thread and enqueues, on the stream, a wait for the worker's counter in pinned
    memory that then reads the result from there and adds it (kernels.wait_host_add; with
    fused_add False, kernels.wait_host_flag, the result's copy up and the sum); the host goes on
    enqueueing the next layers, so the GPU runs them as soon as the CPU's result lands instead
    of after the host has launched them. The worker takes layers in order: it waits for the
    input's copy down (a CUDA event), computes, writes the result into the layer's pinned
    output buffer and then bumps the counter (x86 keeps the two stores in that order).
    Where the wait kernel cannot run, it falls back to waiting on the host (`run_ahead`
    False). On a CPU device (tests) the share is computed at once."""

    device: torch.device
    hidden: int
    max_tokens: int
    slots: int = 1
    stats: HostStats = field(default_factory=HostStats)
    threads: int | None = None  # the worker's torch threads (None: the creating thread's)
    # run-ahead: one kernel waits for the worker, reads its result from pinned memory and adds
    # it (kernels.wait_host_add), instead of a wait, a small copy up behind the ring's layer
    # copies, and an add
    fused_add: bool = True
    # the worker keeps its OpenMP team spinning while it waits for the next input
    # (native ss_omp_touch), rather than letting it sleep and paying for waking it each layer
    keep_warm: bool = True
    # --trace (runtime.trace.Tracer): the worker's wait for each input and its share, as spans
    tracer: object | None = None

    def __post_init__(self) -> None:
        cuda = self.device.type == "cuda"
        shape = (self.max_tokens, self.hidden)
        self._in = [torch.empty(shape, dtype=torch.float32, pin_memory=cuda)
                    for _ in range(self.slots)]
        self._out = [torch.empty(shape, dtype=torch.float32, pin_memory=cuda)
                     for _ in range(self.slots)]
        self._rows = [0] * self.slots
        self._sent: list[torch.cuda.Event | None] = [None] * self.slots
        # the counter value each slot's input raises the arrival flag to (send_to_host), or
        # None where it went by a copy and an event
        self._signal_seq: list[int | None] = [None] * self.slots
        self._h: list[torch.Tensor | None] = [None] * self.slots
        self.run_ahead = cuda
        # the fused shares' inputs go by kernels.send_to_host and a flag the worker polls in
        # native code (SLIPSTREAM_HOST_SIGNAL=1; False once the kernel has failed here)
        self.signal = cuda and envs.get("SLIPSTREAM_HOST_SIGNAL")
        if self.threads is None:
            self.threads = torch.get_num_threads()
        if cuda:
            self._flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            self._arrived = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # signal
            self._failed = torch.zeros(1, dtype=torch.int32, device=self.device)
            self._seq = 0
            self._init_worker()

    def _init_worker(self) -> None:
        """The run-ahead worker's state (no thread yet: the first share starts it)."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._events = EventPool()
        self._scratch = Scratch()  # the worker's alone
        self._error: BaseException | None = None
        self._error_job = ""  # which share raised it
        self._worker: threading.Thread | None = None
        # the share the worker spent longest on: what a GPU wait that gave up waited for (a
        # wait starts once the one before it ended, at or after its share's hand-off)
        self.slowest: JobTimes | None = None

    # --- the host's side ----------------------------------------------------------------------

    def send(self, h: torch.Tensor, slot: int = 0, fused: bool = False) -> None:
        """Queue h's copy to the host on the current stream (no wait here). For a fused share
        (fused) with `signal` on and run-ahead serving: by kernels.send_to_host, which raises
        the arrival flag to the next job's counter after it, for a worker waiting in native
        code."""
        if h.shape[0] > self.max_tokens:
            raise ValueError(f"the CPU share takes at most {self.max_tokens} tokens, "
                             f"not {h.shape[0]}")
        self._rows[slot] = h.shape[0]
        if self.device.type != "cuda":
            self._h[slot] = h.float()
            return
        self._send_down(h, slot, fused)

    def _send_down(self, h: torch.Tensor, slot: int, fused: bool) -> None:
        self._signal_seq[slot] = None
        if fused and self.signal and self.run_ahead:
            try:
                kernels.send_to_host(h, self._in[slot][:h.shape[0]], self._arrived,
                                     self._seq + 1)
                self._signal_seq[slot] = self._seq + 1
            except Exception:  # no kernel here: the copy and the event from now on
                self.signal = False
        if self._signal_seq[slot] is None:
            self._in[slot][:h.shape[0]].copy_(h.float(), non_blocking=True)
        event = self._events.take()  # also where the input went by the flag: the fallbacks'
        event.record()
        self._sent[slot] = event

    def _submit(self, ffn) -> int:
        """Run-ahead: hand the layer's share (a hybrid.share.HostFFN) to the worker, which
        waits for its input's copy itself; returns the job's counter value. Jobs go in layer
        order, as the GPU's waits for their counters do."""
        slot = ffn.slot
        self.check()
        self._seq += 1
        self._start_worker()
        signaled = self._signal_seq[slot] == self._seq  # else: the event, as ever
        self._jobs.put((ffn, self._sent[slot], slot, self._rows[slot], self._seq, signaled,
                        time.perf_counter()))
        return self._seq

    def finish(self, ffn, partial: torch.Tensor) -> torch.Tensor:
        """partial + the CPU's share (ffn.compute of the input `send` queued for ffn.slot), in
        stream order: on CUDA with run-ahead, a kernel on the stream waits for the worker's
        counter and adds the result from pinned memory (the wait kernels' hand-off)."""
        slot, rows = ffn.slot, self._rows[ffn.slot]
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            y = ffn.compute(self._h[slot])
            self._count(ffn, time.perf_counter() - t0)
            return partial + y.to(partial.dtype)
        if self.run_ahead:
            seq = self._submit(ffn)
            try:
                if self.fused_add:
                    try:
                        return kernels.wait_host_add(self._flag, seq, self._failed,
                                                     self._out[slot][:rows], partial)
                    except Exception:  # not built here: the wait, the copy and the add
                        self.fused_add = False
                kernels.wait_host_flag(self._flag, seq, self._failed)
            except Exception:  # no wait kernel here: wait on the host from now on
                self.run_ahead = False
                self._wait_seq(seq)
        else:
            t0 = time.perf_counter()
            self._sent[slot].synchronize()
            self._events.give(self._sent[slot])
            self._out[slot][:rows].copy_(ffn.compute(self._in[slot][:rows]))
            self._count(ffn, time.perf_counter() - t0)
        up = self._out[slot][:rows].to(partial.device, non_blocking=True)
        return partial + up.to(partial.dtype)

    def check(self) -> None:
        """Raise what the worker ran into (the layers after it got a zero share): its own
        exception chained, its type, share and traceback in the message."""
        if self._error is not None:
            error, self._error = self._error, None
            trace = "".join(traceback.format_exception(error)).rstrip()
            raise CpuShareError(f"the CPU's share of hybrid decode failed on the worker thread "
                                f"({self._error_job}): {type(error).__name__}: {error}\n"
                                f"{trace}") from error

    def close(self) -> None:
        """Stop the worker once the layers handed to it are done; raise if a wait on the
        stream gave up (read here only: it costs a device sync)."""
        if self.device.type != "cuda" or self._worker is None:
            return
        self._stop_worker()
        self.check()
        self.check_waits()

    def check_waits(self) -> None:
        """Raise CpuShareError if a GPU wait for a share has given up so far (a device sync:
        close reads it, a test may at any point)."""
        if self.device.type == "cuda" and int(self._failed.item()):
            raise CpuShareError(self.gave_up_message())

    def _stop_worker(self) -> None:
        self._jobs.put(None)
        self._worker.join()
        self._worker = None

    def gave_up_message(self) -> str:
        """What to say when a GPU wait for a share gave up (its timeout, kernels.host_wait):
        the worker's slowest share and where its time went. A share waiting for its input
        as long as the timeout means the input's copy sat behind the GPU's wait for the worker
        itself (a cycle the timeout broke); one computing that long, a stalled worker; one
        shorter than the timeout, a wait that started before its share was handed over."""
        slow = self.slowest
        what = (f"the worker's slowest: {slow.describe()}" if slow is not None
                else "the worker finished no share")
        return (f"a GPU wait for the CPU's share of hybrid decode gave up (its timeout, "
                f"kernels.host_wait), so a layer added a stale result instead of the CPU's; "
                f"{what}")

    # --- the worker's side --------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            switch_s = envs.get("SLIPSTREAM_GIL_SWITCH_S")
            if switch_s > 0:
                sys.setswitchinterval(min(sys.getswitchinterval(), switch_s))
            self._worker = threading.Thread(target=self._work, name="slipstream-hybrid-cpu",
                                            daemon=True)
            self._worker.start()

    def _work(self) -> None:
        flag = self._flag.numpy()
        # a share still running after this many seconds dumps every thread's stack (debug):
        # the GPU's wait gives up at 60 s (kernels.host_wait), a share takes milliseconds
        dump_s = envs.get("SLIPSTREAM_STALL_DUMP_S")
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ffn, sent, slot, rows, seq, signaled, handed = job
            t0 = t1 = None
            tracer = self.tracer
            if dump_s > 0 and not _arm_dump(dump_s):
                dump_s = 0.0
            try:
                if self._error is None:
                    if torch.get_num_threads() != self.threads:
                        torch.set_num_threads(self.threads)  # per thread under OpenMP
                    t0 = time.perf_counter()
                    if signaled:  # the wait, the share and the counter in one native call
                        # (traced, the cores counted over both)
                        c1 = time.process_time() if tracer is not None else 0.0
                        waited = ffn.compute_on_signal(
                            self._in[slot][:rows], self._out[slot][:rows], self._scratch,
                            self._arrived, seq, self._flag, self.threads)
                        t1 = t0 + waited
                    else:
                        self._await(sent)
                        t1 = time.perf_counter()
                        # traced: the process's CPU time over the share (every thread's), so
                        # that the trace says how many cores the share kept busy
                        c1 = time.process_time() if tracer is not None else 0.0
                        ffn.compute_into(self._in[slot][:rows], self._out[slot][:rows],
                                         self._scratch)
                    self._count(ffn, time.perf_counter() - t1)
            except BaseException as e:  # the stream must not wait forever: bump anyway
                self._error = e
                self._error_job = f"layer {getattr(ffn, 'layer', '?')}'s share, job {seq}"
            finally:
                flag[0] = seq
                if dump_s > 0:
                    faulthandler.cancel_dump_traceback_later()
            if sent is not None:
                self._events.give(sent)  # the pool keeps it: never destroyed on this thread
            job = sent = None
            if t0 is not None:
                self._time(ffn, seq, handed, t0, t1)
            if tracer is not None and t1 is not None:
                t2, c2 = time.perf_counter(), time.process_time()
                name = f"L{ffn.layer}"
                tracer.span("cpu wait", name, t0, t1, layer=ffn.layer)
                tracer.span("cpu share", name, t1, t2, layer=ffn.layer, bytes=ffn.nbytes,
                            cores=round((c2 - c1) / (t2 - t1), 2) if t2 > t1 else None)

    def _time(self, ffn, seq: int, handed: float, t0: float, t1: float | None) -> None:
        """Keep the share's times if it is the slowest yet (a share that raised: up to now)."""
        now = time.perf_counter()
        t1 = now if t1 is None else t1
        job = JobTimes(getattr(ffn, "layer", -1), seq, t0 - handed, t1 - t0, now - t1)
        if self.slowest is None or job.own_s > self.slowest.own_s:
            self.slowest = job

    def _await(self, sent: torch.cuda.Event) -> None:
        """Wait for the input's copy down by querying its event (cudaEventQuery, which does
        not wait for the GPU); keep_warm: touching the worker's OpenMP team the while (an
        empty parallel region, well under a microsecond while the team is awake), so that it
        is awake when the input lands."""
        touch = _omp_touch() if self.keep_warm else None
        while not sent.query():  # a query, never a synchronize (see EventPool)
            if touch is not None:
                touch(self.threads)
            else:
                time.sleep(0)

    def _wait_seq(self, seq: int) -> None:
        """Wait on the host until the worker has finished job `seq`."""
        flag = self._flag.numpy()
        while flag[0] < seq and self._worker is not None and self._worker.is_alive():
            time.sleep(0)
        self.check()

    def _count(self, ffn, seconds: float) -> None:
        self.stats.cpu_s += seconds
        self.stats.cpu_bytes += ffn.nbytes


def _arm_dump(seconds: float) -> bool:
    """faulthandler's dump of every thread's stack in `seconds` to the process's stderr (fd
    2), unless cancelled first; False where it cannot be armed (no such stream)."""
    try:
        faulthandler.dump_traceback_later(seconds, exit=False, file=sys.__stderr__)
    except (AttributeError, OSError, ValueError, RuntimeError):
        return False
    return True


def _omp_touch():
    """The native library's ss_omp_touch, or None where it did not build."""
    lib = native.library()
    return lib.ss_omp_touch if lib is not None else None
