"""Hybrid decode's split as the load and the CUDA layer store use it: `HybridSplit` builds the
split layers and their CPU shares at load (memory.setup.pin_streamed_layers) and answers the
store's SplitPolicy (memory.cuda_store): which layers split, where their images end for decode,
the running balance, and the worker's life."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..weights.loader import TensorSource
from .balance import HybridBalance, SplitLayer
from .host_io import HostIO
from .plan import HANDOVER_S, HybridPlan
from .share import HostFFN, host_linears
from .split import REST_FIELDS, ffn_raws, split_layer


@dataclass
class HybridSplit:
    """The split of one model's pinned layers (plan: plan.hybrid) and the CPU shares made for
    them, all through one HostIO."""

    plan: HybridPlan
    io: HostIO
    hosts: dict[int, HostFFN] = field(default_factory=dict)  # split layer -> its CPU share
    rest_fields: tuple[str, ...] = REST_FIELDS  # the image's tail a split decode leaves out
    act: str = "silu"  # the FFN's gated activation (ModelConfig.ffn_act), for the CPU shares
    _packing: dict[int, Future] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, plan, cfg, device: torch.device) -> "HybridSplit | None":
        """The split `plan` (a memory.planner.Plan) asks for, or None where it splits nothing."""
        hybrid = plan.hybrid
        if hybrid is None or device.type != "cuda" or not hybrid.layers:
            return None
        io = HostIO(device, cfg.hidden, hybrid.max_tokens, slots=len(hybrid.layers),
                    threads=hybrid.threads)
        return cls(hybrid, io, act=cfg.ffn_act)

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.plan.layers)

    @property
    def max_tokens(self) -> int:
        """Passes of up to this many tokens split (the host buffers' rows)."""
        return self.io.max_tokens

    # --- at load ---------------------------------------------------------------------------

    @contextmanager
    def packing(self, gf, cfg) -> Iterator[None]:
        """While the caller builds the GPU images, a pool packs the CPU's shares: packing is
        many small torch ops, which release the GIL but use one core each, so each worker runs
        on one thread of its own and the pool is the parallelism."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        pool = ThreadPoolExecutor(max_workers=self.plan.threads)
        try:
            self._packing = {i: pool.submit(host_linears, ffn_raws(TensorSource(gf), cfg, i),
                                            self.plan.keep)
                             for i in sorted(self.plan.layers)}
            yield
        finally:
            pool.shutdown(cancel_futures=True)
            torch.set_num_threads(threads)
            self._packing = {}
        if self.hosts:
            self.plan.extra_ram_bytes = sum(h.extra_ram_bytes for h in self.hosts.values())

    def build_layer(self, builder, src, i: int):
        """Layer i with its FFN in the GPU's and the CPU's shares (hybrid.split.split_layer)."""
        return split_layer(builder, src, i, self.plan.keep)

    def attach(self, i: int) -> None:
        """Layer i's CPU share, once its packing (started by `packing`) is done."""
        parts = self._packing[i].result()
        slot = sorted(self.plan.layers).index(i)
        self.hosts[i] = HostFFN(parts["gate_up"], parts["down"], self.io, slot, i,
                                act=self.act)

    # --- the store's SplitPolicy ------------------------------------------------------------

    def balance(self, prefix: dict[int, int], image: dict[int, int], other_bytes: int,
                ring: list[tuple[int, int]], slots: int) -> HybridBalance | None:
        """The running balance over the split layers (hybrid.balance), where the plan's mode
        asks for one ("auto"; a share the user gave stays as given)."""
        if not self.plan.rebalance or not self.hosts:
            return None
        return HybridBalance({i: SplitLayer(h.nbytes, prefix[i], image[i])
                              for i, h in self.hosts.items()}, other_bytes,
                             self.plan.pcie_gbps, layer_s=HANDOVER_S, ring=ring, slots=slots)

    def count_into(self, stats) -> None:
        """The CPU's seconds and bytes go into `stats` (a StoreStats) from now on."""
        self.io.stats = stats

    def trace(self, tracer) -> None:
        """--trace: the worker's wait for each input and its share, as spans."""
        self.io.tracer = tracer

    def close(self) -> None:
        """Stop the worker once the layers handed to it are done (hybrid.host_io.HostIO)."""
        self.io.close()
