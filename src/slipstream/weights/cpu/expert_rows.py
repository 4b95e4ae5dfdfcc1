"""A prefill's routed experts in one native call (native/moe_rows.c): the many-row mix
(model.moe.ExpertMix) the loader gives a CPU bank of resident experts at precision "fast".

Where every expert of the bank has the native packed form that a decode token's sum takes
(weights.cpu.expert_decode: gate/up q4vnni, q8vnni or cb4, down those or q6vnni; gpt-oss's
biases) and the experts' gated product is one ss_glu_f32 forms (SwiGLU, GeGLU, gpt-oss's
clamped SwiGLU), a layer's T > 1 rows are one call: each row quantized once, the experts'
rows shared out over the threads in chunks, each row's terms added in ascending expert order.
The bits are those of model.moe.experts_ffn over native_expert_ffn, and each row's those of a
decode token (moe_rows.c says why). Else (torch's layouts, iq experts, dense weights) None, and
the bank takes experts_ffn.

On the 2-core AVX-512 EPYC, a 4-layer Qwen3-30B-A3B-shaped Q4_K model's pp512 spent 0.7 of
2.75 s in experts_ffn's index_add_ alone through the per-expert path, and with another
process on one core 5.4 of 11.5 s: each of the ~5,000 small OpenMP regions of a pass waited
for a descheduled thread. A gpt-oss-20b-shaped MXFP4 file cut to 8 layers spent 3.0 of a 5.6 s
pp512 in its experts expert by expert (load 1.1); on its real routing, alternating in one
process at load 3, the 8 layers' experts took 0.27-0.44 s for pp16 in the one call against
0.64-9.7 s expert by expert, and 2.7-5.2 s against 3.2-20 s for pp512 (the per-expert path's
64 OpenMP regions a layer, each stalled by a descheduled thread; three of its layers had an
expert past 256 rows, which that path multiplies dense).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Sequence

import torch

from ... import native
from .expert_decode import DOWN_CB4, DOWN_Q6, GATE_UP_CB4, GLU_ACTS, expert_descriptor

# moe_rows.c's layouts (MOE_ROWS_LAYOUTS): gate/up q4vnni, q8vnni or cb4, down those or q6vnni
ROWS_LAYOUTS = DOWN_Q6 | GATE_UP_CB4 | DOWN_CB4

# Rows of one native call: a longer pass goes in slices of this many. The call's terms buffer
# holds each row's k outputs (512 x 8 x 2048 float32 = 32 MiB for Qwen3-30B-A3B), and a
# slice of 512 still gives each expert ~32 rows (k / n_experts of them) for its weights' one
# read.
MAX_ROWS = 512

_workspace = threading.local()


def _workspace_bytes(n: int) -> torch.Tensor:
    """n bytes of a buffer this thread keeps and grows: a fresh 40 MiB per layer came back
    from the allocator as new pages to fault in each time."""
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):
            buf = _workspace.buf = torch.empty(n, dtype=torch.uint8)
    return buf


class NativeExpertRows:
    """model.moe.ExpertMix for one bank: its experts' descriptor table is made at the first
    call and kept (a bank's experts do not change)."""

    def __init__(self) -> None:
        self._table: ctypes.Array | None = None
        self._key: tuple[int, int] | None = None
        self._usable = True

    def _table_for(self, gate_up: Sequence, down: Sequence) -> ctypes.Array | None:
        key = (id(gate_up), id(down))
        if self._key != key:
            descs = [expert_descriptor(g, d) for g, d in zip(gate_up, down)]
            self._usable = bool(descs) and all(
                d is not None and not d.layouts & ~ROWS_LAYOUTS for d in descs)
            self._table = (ctypes.c_void_p * len(descs))(
                *(ctypes.addressof(d) for d in descs)) if self._usable else None
            self._descs = descs  # the table's entries live as long as it
            self._hidden = descs[0]._keep[0].in_features if self._usable else 0
            self._key = key
        return self._table

    def __call__(self, gate_up: Sequence, down: Sequence, h: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, act: str) -> torch.Tensor | None:
        """sum_j weights[t, j] * expert_{ids[t, j]}(h[t]) for each row t, float32
        (T, hidden), in native calls; None where this bank or call has no native form."""
        lib = native.library()
        if act not in GLU_ACTS or lib is None or h.device.type != "cpu" or h.dim() != 2:
            return None
        table = self._table_for(gate_up, down)
        if table is None:
            return None
        if h.shape[1] != self._hidden or ids.shape != weights.shape or ids.shape[0] != h.shape[0]:
            raise ValueError(f"routed rows {tuple(h.shape)} with ids {tuple(ids.shape)} and "
                             f"weights {tuple(weights.shape)}: the experts take (T, "
                             f"{self._hidden}) rows and (T, k) ids and weights")
        T, k = ids.shape
        x = h.float().contiguous()
        ids = ids.to(torch.int64).contiguous()
        w = weights.float().contiguous()
        out = torch.empty(T, x.shape[1], dtype=torch.float32)
        threads = torch.get_num_threads()
        n = len(table)
        for t0 in range(0, T, MAX_ROWS):
            rows = min(MAX_ROWS, T - t0)
            size = lib.ss_moe_rows_workspace(table, n, rows, k, threads)
            if size < 0:
                return None  # the experts' shapes do not fit the native call together
            ws = _workspace_bytes(size)
            rc = lib.ss_moe_rows(table, n, x[t0].data_ptr(), rows, ids[t0].data_ptr(),
                                 w[t0].data_ptr(), k, out[t0].data_ptr(), ws.data_ptr(),
                                 threads, GLU_ACTS[act])
            if rc <= -2:
                i = t0 * k + (-2 - rc)
                raise ValueError(f"expert id {int(ids.view(-1)[i])} (row {i // k}, slot "
                                 f"{i % k}) is not one of the layer's {n} experts")
            if rc != 0:
                return None
        return out
