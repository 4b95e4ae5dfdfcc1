"""The load's background thread that makes a CPU model's lazy dense weights (and packs the
head's decode copy) while the caller goes on to its first token."""

from __future__ import annotations

import atexit
import dataclasses
import threading

from ..model.llama import LayerWeights
from .cpu import PackedDecodeLinear
from .linear import LazyDenseLinear


def prefetch_dense(layers: list[LayerWeights | None], head=None) -> threading.Thread | None:
    """Make the layers' lazy dense weights (linear.LazyDenseLinear), or the packed copies of
    those whose prefill takes them (PackedDecodeLinear.packed_prefill), in a daemon thread, layer
    by layer in the order a prefill reads them, while the caller goes on (the engine's build,
    the chat template, tokenizing, the first layers' matmuls): a `run` prompt is longer than
    GEMV_MAX_ROWS tokens, and its prefill otherwise waited for the dequantization, 0.5 s of a
    31-token prompt on a busy 2-core machine. A pass that reaches a weight first makes it
    itself (the lock in LazyDenseLinear: made once, the same bits). Then the head's packed
    decode copy (`head`, a PackedDecodeLinear), which the prompt's last row is scored with
    once its layers are through: packing the default model's tied 49152 x 576 head took
    30-90 ms, which the first token otherwise waited for (PackedDecodeLinear's lock: packed
    once). The head's dense weight stays lazy: only passes that score every token use it.
    None where nothing is lazy."""
    lazies: list = []  # LazyDenseLinear (its weight made), or PackedDecodeLinear (packed)
    for layer in layers:
        fields = [getattr(layer, f.name) for f in dataclasses.fields(LayerWeights)
                  ] if layer is not None else []
        # a prefill multiplies these linears' packed copies, never their dense weights (nor
        # the part views of those, q/k/v's and gate/up's, which few paths read)
        skip = {id(lin.dense) for lin in fields
                if isinstance(lin, PackedDecodeLinear) and lin.packed_prefill}
        for lin in fields:
            if isinstance(lin, PackedDecodeLinear) and lin.packed_prefill:
                if not lin.is_packed:
                    lazies.append(lin)
                continue
            dense = getattr(lin, "dense", lin)
            if (isinstance(dense, LazyDenseLinear) and not dense.materialized
                    and id(dense.of) not in skip):
                lazies.append(dense)
    if not lazies:
        return None
    stop = threading.Event()

    def run() -> None:
        try:
            for lin in lazies:
                if stop.is_set():
                    return
                if isinstance(lin, PackedDecodeLinear):
                    lin.packed  # noqa: B018 (packed now)
                else:
                    lin.weight  # noqa: B018 (made now)
            if isinstance(head, PackedDecodeLinear) and not stop.is_set():
                head.packed  # noqa: B018 (made now)
        finally:
            _PREFETCHES.pop(t, None)

    t = threading.Thread(target=run, name="slipstream-dense-prefetch", daemon=True)
    _PREFETCHES[t] = stop
    t.start()
    return t


# running prefetch threads and their stop flags. A daemon thread still inside a torch op when
# the interpreter finalizes aborts the process ("terminate called without an active
# exception", SIGABRT), so at exit each is stopped between two weights and joined: the wait is
# one weight's dequantization at most, not the rest of the model's
_PREFETCHES: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_prefetches() -> None:
    for t, stop in list(_PREFETCHES.items()):
        stop.set()
        t.join()
