"""Hybrid decode's split of a streamed layer: the CPU computes part of the FFN from packed host
weights while PCIe brings the rest of the layer to the GPU.

The split runs along the FFN's intermediate dimension. The GPU keeps intermediate units
[0, keep): rows [0, keep) of gate and up and columns [0, keep) of down; the CPU takes
[keep, ffn). Each side then ends with a partial sum of the down projection over its own units,
so one exchange per layer suffices: the normed input goes to the host, the CPU's partial sum
comes back and is added on the GPU. The FFN is about 80% of a Llama layer's bytes, more than
the CPU's share ever needs to be, and attention stays whole on the GPU.

A split layer keeps its whole FFN in GPU format as well, the units past `keep` in two more
linears (`ffn_gate_up_rest`, `ffn_down_rest`) laid out at the end of the layer's image. Decode
copies only the image's prefix and hands the rest to the CPU (`HostFFN`); prefill and large
speculation trees, FLOP-bound where the CPU is slow, copy the whole image and run the rest on
the GPU. The extra RAM is the CPU's packed copy of its units (weights.cpu_packed), unless the
CPU reads those rest linears in place from the pinned image (kind "planes", hybrid.plane_host):
then there is no extra RAM and nothing to pack.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import BadArgument
from ..weights.cpu_packed import AUTO_KINDS, kind_for, pack_group, pack_linear, packed_nbytes
from .plane_host import KIND as PLANES
from .plane_host import PLANE_FORMATS, PlaneLinear, plane_nbytes, planes_available

# keep (and ffn - keep) in multiples of this: a K-quant block along down's columns (256), and
# whole 64-row blocks of torch's int4 CPU layout along gate/up's rows
SPLIT_ALIGN = 256
REST_FIELDS = ("ffn_gate_up_rest", "ffn_down_rest")  # the image's tail: decode leaves it out
# The CPU's share runs on the native q4vnni/q8vnni kernels that CPU decode takes (kind "auto"),
# where the library builds. Beside the copies they were ahead of torch's int4pack on both GPU
# hosts measured since the VNNI loop prefetches: the H200's (session 28) 4.885 tok/s on the
# 70B at 24 GiB against 4.816, the H100's (session 29) 5.772 and 4.883 against 4.137 and 4.314
# (bench/results/2026-12-05-s29-hybrid-bench-*-h100-call{2,4,5}.json), its CPU share reading
# 77-84 GB/s of q4vnni's 6 bits a Q4_K weight against 50-52 of int4pack's 5. (Session 16's
# H200 had it slower, 3.72 against 4.66, before the probe and the prefetch were fixed.) Their
# load-time packing is native since session 29 (int4_pack.c): 70-85 s loads of the 70B before.
# SLIPSTREAM_HYBRID_KIND (one of cpu_packed.kind_for's automatic choices, or "planes") picks:
# torch takes torch's kernels; auto-f16 rounds Q4_K's scales to float16 (5 bits a weight: 5.315
# tok/s in session 29, its probe overrating the CPU and giving it a 0.71 share); planes reads
# the Q4_0/Q4_1/Q4_K rest linears in place from the pinned image (4.625 bits a Q4_K weight, no
# extra RAM, no packing; other formats as auto). On this 2-core AVX2 machine planes computes
# 12.1 Gweights/s a thread against q4vnni's 15.1 (bench/results/2026-12-05-s30-plane-speed-
# cpu.json): a bet on host memory, not on the cores. It lost that bet on the H200's host
# (session 31, a 16-core Sapphire Rapids, its AVX-512 VNNI loop): 9.0 Gweights/s a thread
# against 14.1, 106 against 132 at 15 threads, 53 GB/s beside the copies against q4vnni's 80
# (about 92 Gweights/s against 106), and the 70B at 24 GiB decoded 4.323 tok/s against 4.460
# (2026-12-05-s31-plane-speed-h200-host-call1.json, -hybrid-bus-*-h200-call2.json,
# -hybrid-bench{,-planes}-h200-call1.json): the CPU's share is compute-bound there too. So it
# stays opt-in; its loop, not the bus, is what to improve. q4vnni packs Q4_K with its own
# scales by default (Q4_KS, weights.cpu_packed; SLIPSTREAM_Q4VNNI_KS=0 for the float32 records):
# the planes' 4.625 bits a weight in q4vnni's loop, packed at load.
# hybrid.plan's probe times the kernel of the kind chosen here.
HOST_KINDS = AUTO_KINDS + (PLANES,)
# The CPU's share in one native call where both its linears are q4vnni/q8vnni (native ss_q4_ffn:
# the two matvecs and the SwiGLU between them, the GIL released once), rather than four calls
# that each hand the GIL back (HostFFN.compute_into). SLIPSTREAM_HOST_FUSED=0: the four calls.
HOST_FUSED = os.environ.get("SLIPSTREAM_HOST_FUSED", "1") != "0"
# Python's GIL switch interval while hybrid decode's CPU worker runs (sys.setswitchinterval; 5 ms
# by default). The worker needs the GIL between its native calls while the main thread holds it
# to enqueue CUDA work (Triton's launches release it rarely); a waiting thread gets it only
# once the holder lets go or this interval passes, and the worker's OpenMP team idles
# meanwhile. On the 2-core CI machine, with a thread beside it that never lets go, an 8B's
# share took a median 18.8 ms fused (35 ms as four calls) at 5 ms and 3.2-3.6 (3.8-6.3) at
# 0.1 ms, against 2.4-5.4 with the thread idle (bench/host_share_gil.py,
# bench/results/2026-12-06-s37-host-share-gil-cpu.txt). Not yet timed on a GPU host.
# Process-wide, and never raised: SLIPSTREAM_GIL_SWITCH_S overrides (0: left alone).
def _seconds_env(name: str, default: str) -> float:
    """A non-negative number of seconds from the environment, or a BadArgument naming it."""
    value = os.environ.get(name, default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise BadArgument(f"{name}={value!r} is invalid: set it to a number of seconds >= 0, "
                          f"or unset it")
    return seconds


GIL_SWITCH_S = _seconds_env("SLIPSTREAM_GIL_SWITCH_S", "0.0001")
# The fused share's input sent by a kernel that writes it into pinned memory and raises a flag
# after it (kernels.send_to_host), the worker waiting for that flag, computing and handing back
# in one native call (ss_q4_ffn_on_signal): no Python, so no GIL, between the input landing and
# the result's counter. Without it the worker polls a CUDA event from Python: on session 37's
# H100 an 8B's split layer took 0.32 ms from its GPU start to its CPU share's start (0.82 ms
# before the share was fused), a 70B's 0.16 (2026-12-06-s37-hybrid-bench-h100-call2.json).
# Off until measured on a GPU: SLIPSTREAM_HOST_SIGNAL=1 turns it on.
HOST_SIGNAL = os.environ.get("SLIPSTREAM_HOST_SIGNAL", "0") == "1"
SIGNAL_TIMEOUT_S = 60.0  # as kernels.host_wait's: far beyond a share, short of a hang
# Run-ahead hands a split layer's share to the worker at start (HostIO.submit), right after
# its input's copy is queued, rather than at finish, after the host has also enqueued the
# GPU's own share: session 39's 8B, bound by the host's enqueue, had its worker learn of each
# layer 1.27 ms into the layer's 1.59 ms enqueue. Off until measured on a GPU:
# SLIPSTREAM_HOST_EARLY=1 turns it on.
HOST_EARLY = os.environ.get("SLIPSTREAM_HOST_EARLY", "0") == "1"
HOST_KIND = os.environ.get("SLIPSTREAM_HYBRID_KIND", "auto")
if HOST_KIND not in HOST_KINDS:
    raise BadArgument(f"SLIPSTREAM_HYBRID_KIND={HOST_KIND!r} is invalid: set it to one of "
                      f"{', '.join(HOST_KINDS)}, or unset it")


def host_kind(qtype: GGMLQuantizationType | int) -> str | None:
    """The CPU layout the CPU's share of a `qtype` matrix takes: "planes" (read in place from
    the pinned image) where HOST_KIND asks for it and the plane kernel reads qtype, else
    cpu_packed.kind_for's choice (None: no CPU layout reads qtype)."""
    if HOST_KIND == PLANES:
        if GGMLQuantizationType(int(qtype)) in PLANE_FORMATS and planes_available():
            return PLANES
        return kind_for(qtype, "auto")
    return kind_for(qtype, HOST_KIND)


def host_nbytes(qtype: GGMLQuantizationType | int, shape: tuple[int, int]) -> int | None:
    """Bytes the CPU reads per pass over a (rows, cols) matrix of `qtype` in host_kind's
    layout (the plane bytes where it reads the image in place)."""
    kind = host_kind(qtype)
    if kind == PLANES:
        return plane_nbytes(qtype, *shape)
    return None if kind is None else packed_nbytes(qtype, shape, kind)


def split_point(ffn: int, cpu_share: float, align: int = SPLIT_ALIGN) -> int:
    """Intermediate units the GPU keeps for a CPU share in [0, 1] of them, rounded to `align`."""
    if not 0.0 <= cpu_share <= 1.0:
        raise ValueError(f"the CPU share of the FFN must be in [0, 1], not {cpu_share!r}")
    cpu = int(round(ffn * cpu_share / align)) * align
    return max(0, min(ffn, ffn - cpu))


def splittable(qtypes: dict[str, GGMLQuantizationType], ffn: int) -> bool:
    """Whether a layer's FFN can be split: gate and up of one format (one fused GPU linear per
    side), and every FFN matrix in a format a CPU layout reads, with blocks that divide the
    split alignment."""
    gate, up, down = (qtypes[n] for n in ("ffn_gate", "ffn_up", "ffn_down"))
    if gate != up or ffn % SPLIT_ALIGN:
        return False
    for q in (gate, down):
        if host_kind(q) is None or SPLIT_ALIGN % GGML_QUANT_SIZES[q][0]:
            return False
    return True


def column_slice(raw: torch.Tensor, qtype: GGMLQuantizationType, rows: int, cols: int,
                 c0: int, c1: int) -> torch.Tensor:
    """The GGUF bytes of columns [c0, c1) of a (rows, cols) matrix: whole blocks of each row,
    copied into a contiguous (rows, bytes) tensor on raw's device."""
    block, tsize = GGML_QUANT_SIZES[qtype]
    if c0 % block or c1 % block or not 0 <= c0 < c1 <= cols:
        raise ValueError(f"columns [{c0}, {c1}) of {cols} do not fall on {block}-wide blocks")
    blocks = raw.reshape(rows, cols // block, tsize)
    return blocks[:, c0 // block:c1 // block].reshape(rows, -1).contiguous()


@dataclass
class FFNRaws:
    """One layer's FFN matrices as GGUF bytes: gate and up (ffn, hidden), down (hidden, ffn)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    qtypes: dict[str, GGMLQuantizationType]
    hidden: int
    ffn: int

    def gate_up_rows(self, r0: int, r1: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Rows [r0, r1) of gate and of up (gate's first): the parts of one fused linear."""
        return [self.gate[r0:r1], self.up[r0:r1]], [(r1 - r0, self.hidden)] * 2

    def down_cols(self, c0: int, c1: int) -> torch.Tensor:
        return column_slice(self.down, self.qtypes["ffn_down"], self.hidden, self.ffn, c0, c1)


def host_linears(raws: FFNRaws, keep: int, image=None) -> dict[str, object]:
    """The CPU's units [keep, ffn): "gate_up" (gate/up rows as one linear) and "down" (down's
    columns), each read in place from the split layer's pinned `image` (its rest linears'
    planes) where host_kind says "planes", else packed for the CPU (weights.cpu_packed, from
    CPU bytes). Without `image` only the packed ones are returned (the rest comes from the
    image once it is built: see in_place_linears)."""
    out = {}
    gate_kind, down_kind = (host_kind(raws.qtypes[n]) for n in ("ffn_gate", "ffn_down"))
    if gate_kind != PLANES:
        parts, shapes = raws.gate_up_rows(keep, raws.ffn)
        qt = raws.qtypes["ffn_gate"]
        out["gate_up"], _ = pack_group([p.cpu() for p in parts], [qt, qt], shapes,
                                       [None, None], gate_kind)
    if down_kind != PLANES:
        out["down"] = pack_linear(raws.down_cols(keep, raws.ffn).cpu(), raws.qtypes["ffn_down"],
                                  (raws.hidden, raws.ffn - keep), kind=down_kind)
    if image is not None:
        out = in_place_linears(image) | out
    return out


def in_place_linears(image) -> dict[str, object]:
    """The CPU's share of a split layer read from its pinned image: "gate_up" and "down" for
    those rest linears whose format host_kind reads in place ("planes")."""
    from ..weights.image import packed_planes

    out = {}
    for key, field_name in (("gate_up", REST_FIELDS[0]), ("down", REST_FIELDS[1])):
        qtype = image.linears[field_name][0]
        if host_kind(qtype) == PLANES:
            out[key] = PlaneLinear(packed_planes(image, field_name))
    return out


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
class HostFFN:
    """The CPU's share of one layer's FFN, the other side of the split (see the module doc).

    `start(h)` queues the normed input's copy to the host behind the kernels enqueued so far;
    the caller then enqueues the GPU's share; `finish(partial)` has the CPU's partial sum
    added to the GPU's on the device (HostIO: at once on a CPU device; on CUDA, by a worker
    thread while the host goes on enqueueing the next layers). `slot`: this layer's input and
    output buffers in `io` (one pair per split layer, so that layers in flight never share)."""

    gate_up: object  # Linear on the CPU: hidden -> 2 * (ffn - keep)
    down: object  # Linear on the CPU: (ffn - keep) -> hidden
    io: "HostIO"
    slot: int = 0
    layer: int = -1  # the model's layer index (names its spans in a trace)
    # _fused's lookup, made once: it runs twice per split layer and token (start and
    # compute_into), on decode's chain, and the library's lookup takes a lock
    _native_ffn: object = field(default=None, init=False, repr=False, compare=False)
    _native_looked_up: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes the CPU reads per token."""
        return self.gate_up.nbytes + self.down.nbytes

    @property
    def extra_ram_bytes(self) -> int:
        """RAM its weights take besides the pinned image (packed copies; none read in
        place)."""
        return sum(p.nbytes for p in (self.gate_up, self.down) if not isinstance(p, PlaneLinear))

    def compute(self, h: torch.Tensor) -> torch.Tensor:
        """The CPU's partial sum of the down projection over its units, for input rows h."""
        if self._fused() is not None:
            out = torch.empty(h.shape[0], self.down.out_features)
            self.compute_into(h.float().contiguous(), out, Scratch())
            return out
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate.float()) * up.float())

    def _fused(self):
        """native ss_q4_ffn where it computes this share (both linears q4vnni/q8vnni, no bias:
        see HOST_FUSED), else None."""
        if not HOST_FUSED:
            return None
        if not self._native_looked_up:
            self._native_ffn = self._find_native_ffn()
            self._native_looked_up = True
        return self._native_ffn

    def _find_native_ffn(self):
        from ..weights.cpu_packed import Q4VnniLinear

        if not all(isinstance(lin, Q4VnniLinear) and lin.bias is None
                   for lin in (self.gate_up, self.down)):
            return None
        from .. import native

        lib = native.library()
        return None if lib is None else lib.ss_q4_ffn

    def compute_into(self, h: torch.Tensor, out: torch.Tensor, scratch: "Scratch") -> None:
        """compute(h) written into `out` (float32, contiguous), with the same bits: where both
        linears are q4vnni/q8vnni, in one native call (HOST_FUSED); else where both multiply
        into a buffer given them (planes, or HOST_FUSED off), through `scratch` and in place,
        with no tensor made per call. The share is on hybrid decode's chain
        (an 8B's took 1.34 ms on an H100 host): on the 2-core CI machine compute and the copy
        into `out` spent 125-218 us of an 8B's share besides its two matvecs, this 95-145
        (bench/results/2026-12-06-s36-host-ffn-overhead-cpu.txt and a run before it; the
        rest is the SiLU, the product and the activations' quantization). h: float32,
        contiguous."""
        fused = self._fused()
        if fused is not None:
            fused(*self._fused_args(h, out, scratch, torch.get_num_threads()))
            return
        if not all(hasattr(lin, "matvec") and getattr(lin, "bias", None) is None
                   for lin in (self.gate_up, self.down)):  # (split layers have no FFN bias)
            out.copy_(self.compute(h))
            return
        m, units = h.shape[0], self.down.in_features
        gate_up = scratch.get(0, m, 2 * units)
        self.gate_up.matvec(h, gate_up)
        act = scratch.get(1, m, units)
        torch.ops.aten.silu.out(gate_up[:, :units], out=act)
        act.mul_(gate_up[:, units:])
        self.down.matvec(act, out)

    def _fused_args(self, h: torch.Tensor, out: torch.Tensor, scratch: "Scratch",
                    threads: int) -> tuple:
        """ss_q4_ffn's arguments (the first eight of ss_q4_ffn_on_signal's): the two weights,
        h, the gate/up and activation buffers from `scratch`, out, the rows and the flags."""
        from ..weights.cpu_packed import q4vnni_flags

        m, units = h.shape[0], self.down.in_features
        gate_up, act = scratch.get(0, m, 2 * units), scratch.get(1, m, units)
        return (self.gate_up.desc, self.down.desc, h.data_ptr(), gate_up.data_ptr(),
                act.data_ptr(), out.data_ptr(), m, q4vnni_flags(True, True, threads))

    def compute_on_signal(self, h: torch.Tensor, out: torch.Tensor, scratch: "Scratch",
                          arrived: torch.Tensor, seq: int, done: torch.Tensor,
                          threads: int) -> float:
        """compute_into(h, out) once arrived[0] >= seq, then done[0] = seq, in one native call
        (HOST_SIGNAL; fused shares only: see _fused). Returns the seconds spent waiting;
        raises RuntimeError if the input does not arrive within SIGNAL_TIMEOUT_S."""
        import ctypes

        from .. import native

        waited = ctypes.c_double(0.0)
        rc = native.library().ss_q4_ffn_on_signal(
            *self._fused_args(h, out, scratch, threads), arrived.data_ptr(), seq,
            done.data_ptr(), threads, SIGNAL_TIMEOUT_S, ctypes.byref(waited))
        if rc != 0:
            raise RuntimeError(f"layer {self.layer}'s input for the CPU's share did not arrive "
                               f"in {SIGNAL_TIMEOUT_S:.0f} s (the GPU stopped; see its error)")
        return waited.value

    def start(self, h: torch.Tensor) -> None:
        self.io.send(h, self.slot, signal=HOST_SIGNAL and self._fused() is not None)
        if HOST_EARLY:
            self.io.submit(self)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        return self.io.finish(self, partial)


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
    # HOST_SIGNAL's send kernel serves here (False once it has failed: copies and events)
    signal_ok: bool = True

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
        # the job each slot's share went to the worker as (submit), until its finish
        self._queued: list[int | None] = [None] * self.slots
        self.run_ahead = cuda
        if self.threads is None:
            self.threads = torch.get_num_threads()
        if cuda:
            self._flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            self._arrived = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # HOST_SIGNAL
            self._failed = torch.zeros(1, dtype=torch.int32, device=self.device)
            self._seq = 0
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()
            self._scratch = Scratch()  # the worker's alone
            self._error: BaseException | None = None
            self._worker: threading.Thread | None = None

    # --- the host's side ----------------------------------------------------------------------

    def send(self, h: torch.Tensor, slot: int = 0, signal: bool = False) -> None:
        """Queue h's copy to the host on the current stream (no wait here). signal: by
        kernels.send_to_host, which raises the arrival flag to the next job's counter after
        it, for a worker waiting in native code (HOST_SIGNAL), where run-ahead serves."""
        if h.shape[0] > self.max_tokens:
            raise ValueError(f"the CPU share takes at most {self.max_tokens} tokens, "
                             f"not {h.shape[0]}")
        self._rows[slot] = h.shape[0]
        if self.device.type != "cuda":
            self._h[slot] = h.float()
            return
        self._signal_seq[slot] = None
        if signal and self.run_ahead and self.signal_ok:
            try:
                from .. import kernels

                kernels.send_to_host(h, self._in[slot][:h.shape[0]], self._arrived,
                                     self._seq + 1)
                self._signal_seq[slot] = self._seq + 1
            except Exception:  # no kernel here: the copy and the event from now on
                self.signal_ok = False
        if self._signal_seq[slot] is None:
            self._in[slot][:h.shape[0]].copy_(h.float(), non_blocking=True)
        event = torch.cuda.Event()  # also where the input went by the flag: the fallbacks'
        event.record()
        self._sent[slot] = event

    def submit(self, ffn: HostFFN) -> None:
        """Run-ahead: hand the layer's share to the worker, which waits for its input's copy
        itself; at the latest in finish, with HOST_EARLY right after send. Jobs go in layer
        order, as the GPU's waits for their counters do."""
        if self.device.type != "cuda" or not self.run_ahead:
            return
        slot = ffn.slot
        self.check()
        self._seq += 1
        self._start_worker()
        signaled = self._signal_seq[slot] == self._seq  # else: the event, as ever
        self._jobs.put((ffn, self._sent[slot], slot, self._rows[slot], self._seq, signaled))
        self._queued[slot] = self._seq

    def finish(self, ffn: HostFFN, partial: torch.Tensor) -> torch.Tensor:
        slot, rows = ffn.slot, self._rows[ffn.slot]
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            y = ffn.compute(self._h[slot])
            self._count(ffn, time.perf_counter() - t0)
            return partial + y.to(partial.dtype)
        if self.run_ahead:
            if self._queued[slot] is None:  # not handed over at start (HOST_EARLY off)
                self.submit(ffn)
            seq, self._queued[slot] = self._queued[slot], None
            try:
                from .. import kernels

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
            self._out[slot][:rows].copy_(ffn.compute(self._in[slot][:rows]))
            self._count(ffn, time.perf_counter() - t0)
        up = self._out[slot][:rows].to(partial.device, non_blocking=True)
        return partial + up.to(partial.dtype)

    def check(self) -> None:
        """Raise what the worker ran into (the layers after it got a zero share)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the CPU's share of hybrid decode failed: {error}") from error

    def close(self) -> None:
        """Stop the worker once the layers handed to it are done; raise if a wait on the
        stream gave up (read here only: it costs a device sync)."""
        if self.device.type != "cuda" or self._worker is None:
            return
        self._jobs.put(None)
        self._worker.join()
        self._worker = None
        self.check()
        if int(self._failed.item()):
            raise RuntimeError("a GPU wait for the CPU's share of hybrid decode gave up: the "
                               "CPU worker stopped answering")

    # --- the worker's side --------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            if GIL_SWITCH_S > 0:
                sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
            self._worker = threading.Thread(target=self._work, name="slipstream-hybrid-cpu",
                                            daemon=True)
            self._worker.start()

    def _work(self) -> None:
        flag = self._flag.numpy()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ffn, sent, slot, rows, seq, signaled = job
            t0 = t1 = None
            tracer = self.tracer
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
            finally:
                flag[0] = seq
            if tracer is not None and t1 is not None:
                t2, c2 = time.perf_counter(), time.process_time()
                name = f"L{ffn.layer}"
                tracer.span("cpu wait", name, t0, t1, layer=ffn.layer)
                tracer.span("cpu share", name, t1, t2, layer=ffn.layer, bytes=ffn.nbytes,
                            cores=round((c2 - c1) / (t2 - t1), 2) if t2 > t1 else None)

    def _await(self, sent: torch.cuda.Event) -> None:
        """Wait for the input's copy down; keep_warm: touching the worker's OpenMP team the
        while (an empty parallel region, well under a microsecond while the team is awake),
        so that it is awake when the input lands."""
        touch = _omp_touch() if self.keep_warm else None
        if touch is None:
            sent.synchronize()
            return
        while not sent.query():
            touch(self.threads)

    def _wait_seq(self, seq: int) -> None:
        """Wait on the host until the worker has finished job `seq`."""
        flag = self._flag.numpy()
        while flag[0] < seq and self._worker is not None and self._worker.is_alive():
            time.sleep(0)
        self.check()

    def _count(self, ffn: HostFFN, seconds: float) -> None:
        self.stats.cpu_s += seconds
        self.stats.cpu_bytes += ffn.nbytes


def _omp_touch():
    """The native library's ss_omp_touch, or None where it did not build."""
    from .. import native

    lib = native.library()
    return lib.ss_omp_touch if lib is not None else None


def ffn_raws(src, cfg, i: int) -> FFNRaws:
    """Layer i's FFN bytes from a TensorSource (weights.loader), on the host."""
    p = f"blk.{i}"
    shapes = {"ffn_gate": (cfg.ffn, cfg.hidden), "ffn_up": (cfg.ffn, cfg.hidden),
              "ffn_down": (cfg.hidden, cfg.ffn)}
    raws = {n: src.raw(f"{p}.{n}.weight", s) for n, s in shapes.items()}
    qtypes = {n: GGMLQuantizationType(int(src.type_of(f"{p}.{n}.weight"))) for n in shapes}
    return FFNRaws(raws["ffn_gate"], raws["ffn_up"], raws["ffn_down"], qtypes, cfg.hidden,
                   cfg.ffn)


def layer_splittable(src, cfg, i: int) -> bool:
    """Whether layer i's FFN can be split (splittable(), and no FFN biases to share out)."""
    p = f"blk.{i}"
    if any(src.has(f"{p}.{n}.bias") for n in ("ffn_gate", "ffn_up", "ffn_down")):
        return False
    qtypes = {n: GGMLQuantizationType(int(src.type_of(f"{p}.{n}.weight")))
              for n in ("ffn_gate", "ffn_up", "ffn_down")}
    return splittable(qtypes, cfg.ffn)


def split_layer(builder, src, i: int, keep: int):
    """Layer i built by `builder` (weights.loader.LayerBuilder) with its FFN in two shares of
    intermediate units, [0, keep) in ffn_gate_up/ffn_down and the rest in ffn_gate_up_rest/
    ffn_down_rest, each in the builder's format (quantized for the GPU kernels, or dense on a
    CPU device). The layer is the same function of its input as the unsplit one; only the
    order of the down projection's sums differs."""
    from ..weights.linear import DenseLinear, QuantLinear

    cfg = builder.cfg
    if not 0 < keep < cfg.ffn or keep % SPLIT_ALIGN:
        raise ValueError(f"cannot keep {keep} of {cfg.ffn} FFN units on the GPU: 0 < keep < "
                         f"{cfg.ffn}, in multiples of {SPLIT_ALIGN}")
    layer = builder.build(src, i)
    raws = ffn_raws(src, cfg, i)
    dev = builder.device

    def linear(parts, qtype, shape):
        if builder.quantized:
            from .. import kernels

            raw = torch.cat([p.to(dev) for p in parts])
            return QuantLinear(kernels.pack_weight(raw, qtype, *shape), None,
                               builder.workspace, builder.fuse_scales)
        from .. import quant

        dense = torch.cat([quant.dequantize(p, qtype, (p.shape[0], shape[1])) for p in parts])
        return DenseLinear(dense.to(device=dev, dtype=builder.precision.weight_dtype))

    def gate_up(r0, r1):
        parts, _ = raws.gate_up_rows(r0, r1)
        return linear(parts, raws.qtypes["ffn_gate"], (2 * (r1 - r0), cfg.hidden))

    def down(c0, c1):
        return linear([raws.down_cols(c0, c1)], raws.qtypes["ffn_down"], (cfg.hidden, c1 - c0))

    layer.ffn_gate = layer.ffn_up = None
    layer.ffn_gate_up, layer.ffn_down = gate_up(0, keep), down(0, keep)
    layer.ffn_gate_up_rest, layer.ffn_down_rest = gate_up(keep, cfg.ffn), down(keep, cfg.ffn)
    return layer
