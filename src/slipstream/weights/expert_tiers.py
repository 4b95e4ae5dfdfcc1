"""A mixture of experts placed expert by expert on the CPU: some experts of a layer held in
RAM, the others read from the GGUF file when a token routes to them (model.moe.ExpertBank).

An expert's bytes of each projection (gate, up, down) are one contiguous slice of the
layer's 3-D tensors (weights.experts; gate and up may be the halves of one tensor's), so a
cold expert costs three reads. Its linears are then
built by the same function as a resident expert's (weights.experts.expert_linears) from the
same bytes, so its outputs are bit for bit the resident load's.

Policy, per layer (the plan gives each layer `slots` experts' worth of RAM): the first
`slots` experts are built at the load. Every call counts the rows routed to its expert. A
call to an expert not held (a miss) reads and builds it; it then takes a RAM slot if one is
free, or the slot of the least used held expert if it has now been used more than that one
(ties keep the held one, so two equally used experts do not evict each other in turn);
otherwise it is dropped after the call. The most used experts so end up in RAM, whatever the
first guess, and an expert used once in a long while does not push a popular one out. Every
DECAY_ROWS rows the layer's counts are halved, so that they follow a change of popularity (a
server's next conversation) within a few thousand tokens rather than never; halving keeps
their order, so it evicts nothing by itself.

Read-ahead (weights.expert_ahead): a layer's cold experts may be read before the layer asks
for them, on the file's background thread (`read_ahead`); a miss then takes those bytes (the
same bytes, so the same bits) instead of reading on the critical path. A guessed expert the
layer does not route to is a wasted read, dropped when the layer's call ends."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import BadArgument, GGUFError
from ..model.moe import ExpertRows, OneTokenSum, expert_ffn, expert_sum, experts_ffn

# Rows routed to a layer's experts between two halvings of its counts: 8192 rows are 1024
# tokens of Qwen3-MoE (8 experts a token), 4096 of Mixtral (2)
DECAY_ROWS = 8192

# the name of the read-ahead thread (ExpertFile.read_ahead), its number appended
AHEAD_THREAD = "slipstream-expert-ahead"

# gate/up and down linears of one expert
ExpertPair = tuple[object, object]


@dataclass(frozen=True)
class ExpertSlice:
    """Where one projection of a layer's experts lies in the file: expert 0's first byte of
    it, the bytes from one expert to the next in its 3-D tensor, and one expert's byte rows of
    it (rows, row_bytes): the whole of each expert's block, or half of it where gate and up
    share a tensor (model.layer_spec.ExpertPart)."""

    offset: int
    expert_bytes: int
    rows: int
    row_bytes: int

    def of(self, e: int) -> tuple[int, int]:
        """(file offset, length) of expert e's bytes."""
        return self.offset + e * self.expert_bytes, self.rows * self.row_bytes


class ExpertFile:
    """The model's file, opened once for every layer's cold experts, and the counters of
    their use (`stats`: any object with expert_hits, expert_misses, expert_bytes_read,
    expert_read_s and the read-ahead's expert_ahead_reads, expert_ahead_bytes and
    expert_ahead_hits; the runtime points it at its store's StoreStats). Cold experts read
    ahead (read_ahead) are read on a thread of its own, which close() stops."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self.stats: object = ExpertCounts()
        self._lock = threading.Lock()  # counters: a server's worker and a bench may share it
        self._ahead: ThreadPoolExecutor | None = None  # the read-ahead thread, once started

    def read(self, sl: ExpertSlice, e: int) -> torch.Tensor:
        """Expert e's bytes of one tensor, (rows, row_bytes) uint8, in memory of its own."""
        t0 = time.perf_counter()
        t, n = self._pread(sl, e)
        self.count(bytes_read=n, seconds=time.perf_counter() - t0)
        return t

    def read_into(self, sl: ExpertSlice, e: int, out: torch.Tensor) -> None:
        """`read`, into `out` (contiguous uint8 of the bytes' size: a pinned staging buffer's
        view, weights.expert_stream), with no buffer of its own."""
        offset, n = sl.of(e)
        if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != n:
            raise BadArgument(f"a buffer of {out.numel()} {out.dtype} elements for expert "
                              f"{e}'s {n} bytes: needs a contiguous uint8 one of that size")
        t0 = time.perf_counter()
        self._pread_into(memoryview(out.view(-1).numpy()), offset, n, e)
        self.count(bytes_read=n, seconds=time.perf_counter() - t0)

    def read_ahead(self, slices: list[ExpertSlice], e: int) -> Future:
        """Expert e's bytes of each of `slices`, as `read` gives them, read on the file's
        background thread (started at the first call): a Future of the list. Its error, if
        any (a file cut short), is raised by the Future's result()."""
        with self._lock:
            if self._fd < 0:
                raise GGUFError(f"{self.path}: read ahead after the file was closed")
            if self._ahead is None:
                # one thread: reads of one file on one disk gain little from more, and a
                # second would contend for the cores the layers compute on
                self._ahead = ThreadPoolExecutor(1, thread_name_prefix=AHEAD_THREAD)
            return self._ahead.submit(self._read_all, slices, e)

    def _read_all(self, slices: list[ExpertSlice], e: int) -> list[torch.Tensor]:
        """(the read-ahead thread) counted once read whole: a read cancelled before it
        started, or failed, counts nothing"""
        out = [self._pread(sl, e) for sl in slices]
        with self._lock:
            self.stats.expert_ahead_reads += 1
            self.stats.expert_ahead_bytes += sum(n for _, n in out)
        return [t for t, _ in out]

    def _pread(self, sl: ExpertSlice, e: int) -> tuple[torch.Tensor, int]:
        offset, n = sl.of(e)
        buf = bytearray(n)
        self._pread_into(memoryview(buf), offset, n, e)
        return torch.frombuffer(buf, dtype=torch.uint8).view(sl.rows, sl.row_bytes), n

    def _pread_into(self, view: memoryview, offset: int, n: int, e: int) -> None:
        done = 0
        while done < n:  # pread may return short
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:  # the file shrank since it was loaded
                raise GGUFError(f"{self.path}: expert {e}'s bytes end past the file: read "
                                f"{done} of {n} bytes at offset {offset}")
            done += got

    def count(self, hits: int = 0, misses: int = 0, bytes_read: int = 0,
              seconds: float = 0.0, ahead_hits: int = 0) -> None:
        with self._lock:
            s = self.stats
            s.expert_hits += hits
            s.expert_misses += misses
            s.expert_ahead_hits += ahead_hits
            s.expert_bytes_read += bytes_read
            s.expert_read_s += seconds

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Stops the read-ahead thread (reads not started are cancelled, a running one
        finishes), then gives the descriptor back."""
        if self._ahead is not None:
            self._ahead.shutdown(wait=True, cancel_futures=True)
            self._ahead = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


@dataclass
class ExpertCounts:
    """The counters an ExpertFile keeps where no store's stats are given."""

    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes_read: int = 0
    expert_read_s: float = 0.0
    expert_ahead_reads: int = 0
    expert_ahead_bytes: int = 0
    expert_ahead_hits: int = 0


class TieredExperts:
    """A layer's experts, at most `slots` of them held in RAM, the others read from `file`
    per use (see the module doc for the policy). `make(e, raws)` builds expert e's linears
    from its bytes, one (rows, row_bytes) tensor per entry of `slices`; `held` are the
    experts built at the load."""

    def __init__(self, n_experts: int, slots: int, file: ExpertFile,
                 slices: list[ExpertSlice], make: Callable[[int, list[torch.Tensor]], ExpertPair],
                 held: dict[int, ExpertPair], decay_rows: int = DECAY_ROWS,
                 act: str = "silu", one_token: OneTokenSum = expert_sum,
                 rows: ExpertRows = expert_ffn):
        if not 0 <= slots <= n_experts:
            raise BadArgument(f"slots={slots} is invalid: between 0 and the layer's "
                              f"{n_experts} experts")
        if len(held) > slots:
            raise BadArgument(f"{len(held)} experts held for {slots} RAM slots")
        self._n = n_experts
        self.slots = slots
        self.file = file
        self.slices = slices
        self.make = make
        self.held = dict(held)
        self.uses = [0] * n_experts  # rows routed to each expert, halved every decay_rows
        self.decay_rows = decay_rows
        self.act = act  # the experts' gated product (model.moe.expert_ffn)
        self.one_token = one_token  # a token's sum of its experts (ffn_one), as resident
        self.rows = rows  # an expert on its rows (ffn), as resident
        self._rows = 0
        self.pending: dict[int, Future] = {}  # experts being read ahead (read_ahead)

    @property
    def n_experts(self) -> int:
        return self._n

    def mix(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        try:
            return experts_ffn(h, ids, weights, self)
        finally:
            self.drop_pending()

    def read_ahead(self, experts: Iterable[int]) -> None:
        """Starts reading those of `experts` that are neither held nor being read: a guess
        of the next call's routing (weights.expert_ahead)."""
        for e in experts:
            if e not in self.held and e not in self.pending:
                self.pending[e] = self.file.read_ahead(self.slices, e)

    def drop_pending(self) -> None:
        """Forgets the reads ahead no call took (wrong guesses): those not started are
        cancelled, a running one finishes unread (its error, if any, unseen: a real miss
        reads again, and raises it)."""
        for f in self.pending.values():
            f.cancel()
        self.pending.clear()

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._pair(e, h.shape[0])
        return self.rows(gate_up, down, h, self.act)

    def ffn_one(self, ids: list[int], weights: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One token's experts, each counted and found (or read) as ffn's, then summed as a
        resident bank sums them (the same `one_token`, so the same bits)."""
        return self.one_token([self._pair(e, 1) for e in ids], weights, h, self.act)

    def _pair(self, e: int, rows: int) -> ExpertPair:
        """Expert e's linears for a call of `rows` rows: counted, then held or read."""
        self.uses[e] += rows
        self._rows += rows
        if self._rows >= self.decay_rows:
            self.uses = [u // 2 for u in self.uses]
            self._rows = 0
        pair = self.held.get(e)
        if pair is not None:
            self.file.count(hits=1)
        else:
            self.file.count(misses=1)
            ahead = self.pending.pop(e, None)
            if ahead is not None:  # read ahead: wait for it, if it still runs
                t0 = time.perf_counter()
                raws = ahead.result()  # (the thread's error, if it failed)
                self.file.count(ahead_hits=1, seconds=time.perf_counter() - t0)
            else:
                raws = [self.file.read(sl, e) for sl in self.slices]
            pair = self.make(e, raws)
            self._admit(e, pair)
        return pair

    def _admit(self, e: int, pair: ExpertPair) -> None:
        if len(self.held) < self.slots:
            self.held[e] = pair
            return
        if not self.held:
            return  # no RAM slot at all: every use reads
        victim = min(self.held, key=lambda x: (self.uses[x], -x))
        if self.uses[e] > self.uses[victim]:
            del self.held[victim]
            self.held[e] = pair
