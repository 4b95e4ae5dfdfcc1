"""Placement: where a model's layers may live and how the streamed ones move, in one value.

    slipstream.load("70b.gguf", device="cuda",
                    placement=Placement(vram_budget="24GiB", ram_budget="96GiB"))

`load()` and `plan()` take it whole, as transformers' `max_memory` or vLLM's `EngineArgs` group
theirs; the defaults place a model in what the machine has free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Placement:
    """How `load()` places a model on its device(s).

    vram_budget (CUDA): bytes (or "24GiB") of VRAM the model may hold, default what is free;
    a reserve computed from the shapes (KV cache for ctx, activations, workspace, slots) comes
    out of it and layers stay resident while the rest lasts; while the model lives, torch's
    caching allocator is capped at what the process held before plus the budget
    (memory.vram_cap), and a load that would pass it raises BudgetTooSmall. With one device
    per stage (load's device=[...]), a list ("24GiB,12GiB") gives one budget per stage.

    ram_budget: bytes of RAM for layers (default MemAvailable less a margin): dequantized
    resident layers on CPU, pinned layer images on CUDA (tier B). The layers that fit neither
    are read from disk on every token (tier C). A mixture of experts on the CPU places experts,
    not layers: its dense part resident, as many experts per layer as the rest holds, the
    others read from the file when routed to (memory.expert_plan).

    vram_layers (CUDA): hold at most this many layers in VRAM, whatever the budget allows
    (llama.cpp's -ngl); the rest stream from pinned RAM or disk as the budgets say.

    gpu_slots (CUDA, >= 2): the ring of GPU slots streamed layers are copied into.

    io: "direct" (O_DIRECT reads, the default), "buffered", "kvikio" (CUDA: KvikIO into GPU
    memory), or "mmap" (the naive baseline: page cache, pageable copies).

    hybrid (CUDA, layers streamed from pinned RAM): "auto" (default) lets the CPU compute part
    of each such layer's FFN during decode, from a packed copy in RAM, while PCIe brings the
    rest, when the bandwidths measured at start-up predict it at least 5% faster (the plan
    shows the split and the prediction; hybrid.plan); "on" splits whatever it predicts, "off"
    never, a number in (0, 1] sets the CPU's share. Not bit-identical to "off": the CPU
    kernels round weights' scales and activations to bfloat16, so "auto" stays off at
    precision="exact" (where a token must not depend on the batch it ran in: plain against
    speculative decoding, say). threads: the CPU threads of that share (default: three
    quarters of the cores); torch's whole process then computes with them.

    private_weights: copy every weight that would stay a view of the file's memory map (the
    token embedding, F32 norms, F16 weights at float16) into private memory, and drop the
    map's pages after the load, so that a file truncated or overwritten under the running
    model cannot kill it (SIGBUS) or change its output (weights.loader). None: on CPU yes (the
    default model: the 28.7 MiB embedding copied, RSS 104 MiB lower, its file pages dropped),
    on CUDA no (only a streamed plan's host embedding is concerned; True copies it).

    distributed: one stage per process under torchrun (runtime.pipeline): this process loads
    and plans only its rank's contiguous range of layers, within its own budgets (the
    embedding on rank 0, the head on the last rank). Rank 0's model generates as usual; the
    others call `model.serve()` until rank 0 closes its model. A draft file is loaded by
    rank 0 alone, out of its budgets, and verified across the ranks. device "auto" is the GPU
    LOCAL_RANK names (NCCL), or the CPU (gloo).
    """

    vram_budget: str | int | Sequence[str | int] | None = None
    ram_budget: str | int | None = None
    vram_layers: int | None = None
    gpu_slots: int = 2
    io: str = "direct"
    hybrid: str | float = "auto"
    threads: int | None = None
    private_weights: bool | None = None
    distributed: bool = False
