"""The CPU's side of a split layer: its packed linears (`host_linears`) and `HostFFN`, which
computes the CPU's partial sum of the down projection over its units, in one native call where
both linears are q4vnni/q8vnni (native/q4_matvec.c's ss_q4_ffn), else through torch's kernels.
The hand-off to and from the GPU is HostIO's (hybrid.host_io)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from .. import native
from ..model.llama import gated
from ..weights.cpu import kind_for, pack_group, pack_linear
from ..weights.cpu.vnni import Q4VnniLinear, q4vnni_flags
from .host_io import HostIO, Scratch
from .split import FFNRaws

SIGNAL_TIMEOUT_S = 60.0  # as kernels.host_wait's: far beyond a share, short of a hang


def host_linears(raws: FFNRaws, keep: int) -> dict[str, object]:
    """The CPU's units [keep, ffn) packed for the CPU (weights.cpu, from CPU bytes): "gate_up"
    (gate/up rows as one linear) and "down" (down's columns)."""
    gate_kind, down_kind = (kind_for(raws.qtypes[n]) for n in ("ffn_gate", "ffn_down"))
    parts, shapes = raws.gate_up_rows(keep, raws.ffn)
    qt = raws.qtypes["ffn_gate"]
    gate_up, _ = pack_group([p.cpu() for p in parts], [qt, qt], shapes, [None, None], gate_kind)
    down = pack_linear(raws.down_cols(keep, raws.ffn).cpu(), raws.qtypes["ffn_down"],
                       (raws.hidden, raws.ffn - keep), kind=down_kind)
    return {"gate_up": gate_up, "down": down}


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
    io: HostIO
    slot: int = 0
    layer: int = -1  # the model's layer index (names its spans in a trace)
    act: str = "silu"  # the gated activation between the matvecs (ModelConfig.ffn_act)
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
        """RAM its packed weights take besides the pinned image."""
        return self.gate_up.nbytes + self.down.nbytes

    def compute(self, h: torch.Tensor) -> torch.Tensor:
        """The CPU's partial sum of the down projection over its units, for input rows h."""
        if self._fused() is not None:
            out = torch.empty(h.shape[0], self.down.out_features)
            self.compute_into(h.float().contiguous(), out, Scratch())
            return out
        return self.down(gated(self.act, self.gate_up(h).float()))

    def _fused(self):
        """native ss_q4_ffn where it computes this share (both linears q4vnni/q8vnni, no bias),
        else None: the share then runs on torch's kernels (int4pack, where the native library
        does not build or SLIPSTREAM_Q4VNNI=0)."""
        if not self._native_looked_up:
            self._native_ffn = self._find_native_ffn()
            self._native_looked_up = True
        return self._native_ffn

    def _find_native_ffn(self):
        if not all(isinstance(lin, Q4VnniLinear) and lin.bias is None
                   for lin in (self.gate_up, self.down)):
            return None
        lib = native.library()
        return None if lib is None else lib.ss_q4_ffn

    def compute_into(self, h: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
        """compute(h) written into `out` (float32, contiguous), with the same bits: where both
        linears are q4vnni/q8vnni in one native call (the two matvecs and the SwiGLU between
        them, the GIL released once), with no tensor made per call. The share is on hybrid
        decode's chain (an 8B's took 1.34 ms on an H100 host). h: float32, contiguous."""
        fused = self._fused()
        if fused is None:
            out.copy_(self.compute(h))
            return
        fused(*self._fused_args(h, out, scratch, torch.get_num_threads()))

    def _fused_args(self, h: torch.Tensor, out: torch.Tensor, scratch: Scratch,
                    threads: int) -> tuple:
        """ss_q4_ffn's arguments (the first eight of ss_q4_ffn_on_signal's): the two weights,
        h, the gate/up and activation buffers from `scratch`, out, the rows and the flags."""
        m, units = h.shape[0], self.down.in_features
        gate_up, act = scratch.get(0, m, 2 * units), scratch.get(1, m, units)
        return (self.gate_up.desc, self.down.desc, h.data_ptr(), gate_up.data_ptr(),
                act.data_ptr(), out.data_ptr(), m,
                q4vnni_flags(True, True, threads, gelu=self.act == "gelu_tanh"))

    def compute_on_signal(self, h: torch.Tensor, out: torch.Tensor, scratch: Scratch,
                          arrived: torch.Tensor, seq: int, done: torch.Tensor,
                          threads: int) -> float:
        """compute_into(h, out) once arrived[0] >= seq, then done[0] = seq, in one native call
        (SLIPSTREAM_HOST_SIGNAL; fused shares only: see _fused). Returns the seconds spent
        waiting; raises RuntimeError if the input does not arrive within SIGNAL_TIMEOUT_S."""
        waited = ctypes.c_double(0.0)
        rc = native.library().ss_q4_ffn_on_signal(
            *self._fused_args(h, out, scratch, threads), arrived.data_ptr(), seq,
            done.data_ptr(), threads, SIGNAL_TIMEOUT_S, ctypes.byref(waited))
        if rc != 0:
            raise RuntimeError(f"layer {self.layer}'s input for the CPU's share did not arrive "
                               f"in {SIGNAL_TIMEOUT_S:.0f} s (the GPU stopped; see its error)")
        return waited.value

    def start(self, h: torch.Tensor) -> None:
        """Queue the normed input's copy to the host (by the signal kernel where the io sends
        that way and the share is fused)."""
        self.io.send(h, self.slot, fused=self._fused() is not None)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        return self.io.finish(self, partial)
