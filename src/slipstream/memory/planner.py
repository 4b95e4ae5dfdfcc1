"""The tier plan: which layers stay resident, which stream each token, and from where.

On CPU "resident" means dequantized in RAM (tier B's role); the rest is read from the GGUF file
on every token (tier C): earlier layers resident, the tail streamed, so the reader prefetches
the streamed run sequentially from the file. On CUDA as many layers stay in VRAM as the VRAM
budget holds (after its reserve), the streamed ones spread evenly between them so that each
copy overlaps the compute before it (`_interleave`); of the streamed layers, the first ones
in layer order are kept in pinned RAM while the RAM budget lasts (tier B), and the rest is read
from disk every token (tier C), from an image file laid out in that order. The plan also
predicts decode speed from bandwidths measured at start-up.

On CPU a decode token is bound by the CPU (cpu_token_seconds): every layer and the head compute
as matvecs (through packed copies at precision "fast", dense at "exact"), and each streamed
layer is first made from the bytes read for it: views into its packed image ("fast"), or
rebuilt from its GGUF bytes ("exact"); the reader threads fetch those bytes ahead, so the disk
only shows where it is slower than all of that.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.table import Table

from ..errors import BudgetTooSmall
from .budget import fmt_bytes

if TYPE_CHECKING:
    from ..hybrid.plan import HybridPlan

# The plan table warns when the hypervisor took at least this many cores while the CPU was
# probed (HybridPlan.cores_stolen): hybrid decode's team of threads waits on the cores taken
STOLEN_WARN_CORES = 0.25


@dataclass(frozen=True)
class StagePlan:
    """One stage of a model: a device and a contiguous range of layers, with their own KV
    cache; the first stage holds the token embedding, the last one the head. A model on one
    device is one stage."""

    device: str
    layers: range
    holds_embedding: bool = True
    holds_head: bool = True


@dataclass(frozen=True)
class Plan:
    """The tier plan of one stage (per-layer lists are indexed from the stage's first layer;
    with one stage, by layer index). `stages` lists the stages the engine chains.

    Frozen: a plan is made complete by the planner, and code that changes it later (a stage's
    padding, the hybrid split, a draft's share, layers promoted once a draft is released)
    makes a new one with dataclasses.replace. Only `bandwidth_gbps` fills in place, as the
    links are measured."""

    device: str
    # per layer: "ram"/"packed"/"disk" on CPU; "vram"/"pinned"/"disk" on CUDA. A CPU "packed"
    # layer holds only its packed decode image in RAM: decode reads nothing, nor does prefill
    # where the image serves it too (weights.cpu_image.prefills_from_image), else prefill
    # rebuilds it from the file as a "disk" layer's
    tiers: list[str]
    # memory a resident layer takes (RAM, or VRAM); a CPU "packed" layer's: its image
    resident_bytes_per_layer: list[int]
    # bytes one use of a streamed layer moves: its GGUF span on CPU, its image on CUDA (the
    # bytes of a slot, read from the image file for the disk tier)
    file_bytes_per_layer: list[int]
    fixed_bytes: int  # head, norms, KV cache, ...: needed whatever the plan (not the slots)
    budget: int | None  # RAM on CPU, VRAM on CUDA
    staging_buffers: int  # CPU: staging buffers; CUDA: GPU slots
    # GB/s by link: "ram", "vram", "pinned", "disk"; on CPU also "compute", "gemv" and
    # "rebuild" (per byte of a decode step's parts: memory.probes.cpu_decode_rates)
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    ram_budget: int | None = None  # CUDA: pinned RAM for tier B images and tier C staging
    host_staging: int = 0  # CUDA: pinned staging buffers of the disk tier
    reserve: dict[str, int] = field(default_factory=dict)  # CUDA: fixed_bytes by part
    io: str = "direct"
    graphs: bool = True  # CUDA: the reserve holds CUDA graph pools (False: decode runs eager)
    embed_on_host: bool = False  # CUDA: the token embedding stays in host memory
    # CUDA: resident layers' scales folded into one plane (precision "fast"; streamed plans
    # keep the GGUF layout, 7.5% smaller on a 70B Q4_K layer: more layers fit), and the cap
    # on the prefill scratch in elements (None: the largest weight)
    fuse_scales: bool = True
    # CUDA: each resident layer in one buffer laid out as its image (streamed plans:
    # weights.image.flattened leaves no allocator holes between layers)
    flat_layers: bool = False
    scratch_elements: int | None = None
    prefill_chunk: int | None = None  # CUDA: the engine's prefill chunk (None: its default)
    stages: list[StagePlan] = field(default_factory=list)  # default: one, every layer
    # a speculative draft placed before this plan: (what it is, bytes it holds of the budget)
    draft: tuple[str, int] | None = None
    # CUDA: the user's cap on layers in VRAM (vram_layers, as llama.cpp's -ngl), or None
    vram_layers: int | None = None
    # CPU: dense bytes of the head's weight, one matvec over them per token (0: not known, or a
    # stage without the head)
    head_bytes: int = 0
    # CUDA: bytes of the user's VRAM budget kept for what the driver counts beside the
    # allocator (memory.cuda_context); `budget` is what is left for the allocator
    outside_allocator: int = 0
    # CUDA: the pinned layers' FFN split with the CPU (hybrid.plan), or None
    hybrid: "HybridPlan | None" = None
    # CPU: every layer decodes through packed copies, the bytes of its image, which are its
    # file_bytes_per_layer (the disk layers' images are read per token); prefill reads the
    # images too where they serve it (weights.cpu_image.prefills_from_image), else the packed
    # and disk layers' GGUF spans, through prefill_staging bytes of buffers (held by the plan
    # either way: the store makes them only where some layer reads its span)
    cpu_images: bool = False
    prefill_staging: int = 0
    # CPU: the head holds its GGUF bytes, not its dense weight (memory.setup._plan_cpu)
    head_dense_on_demand: bool = False
    # CPU, a mixture of experts placed expert by expert (memory.expert_plan): per layer, how
    # many of its n_experts stay in RAM (None: all of them), the RAM one expert takes built,
    # and the file bytes one cold expert reads
    expert_slots: list[int] | None = None
    n_experts: int = 0
    expert_bytes: int = 0
    expert_read_bytes: int = 0
    # the layers with experts, where some have a dense FFN instead (GLM-4.5's first; their
    # slots are 0); empty: every layer
    expert_layers: tuple[int, ...] = ()
    # CUDA, a mixture of experts split with the CPU (memory.expert_split_plan): per layer,
    # how many experts VRAM slots hold (the CPU computes the others: expert_slots of them
    # held in RAM, the rest read from the file), and the VRAM one expert takes
    vram_expert_slots: list[int] | None = None
    expert_vram_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.stages:  # frozen: the default set once, as the plan is made
            object.__setattr__(self, "stages", [StagePlan(self.device, range(len(self.tiers)))])

    @property
    def disk_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "disk"]

    @property
    def streamed_layers(self) -> list[int]:
        """Layers read from somewhere else than where they compute, at least in some passes
        (a CPU "packed" layer in prefill)."""
        return [i for i, t in enumerate(self.tiers) if t in ("disk", "pinned", "packed")]

    def bytes_per_token(self, tier: str) -> int:
        if tier == "disk" or (tier == "pinned" and self.device == "cuda"):
            return sum(b for b, t in zip(self.file_bytes_per_layer, self.tiers) if t == tier)
        return sum(b for b, t in zip(self.resident_bytes_per_layer, self.tiers) if t == tier)

    @property
    def slot_bytes(self) -> int:
        return max((self.file_bytes_per_layer[i] for i in self.streamed_layers), default=0)

    @property
    def predicted_tok_s(self) -> float | None:
        """Decode rate if every link ran at its measured bandwidth.

        CUDA: disk reads and host-to-device copies overlap (the copy link carries the pinned
        and the disk layers); the resident layers' compute is counted on top, though
        interleaving lets copies run under it (a bound a few % low in decode, where the copies
        dominate). CPU: see cpu_token_seconds."""
        if self.device == "cuda" and self.hybrid is not None and self.hybrid.predicted_tok_s:
            return self.hybrid.predicted_tok_s  # the split's own prediction (hybrid_plan)
        return self.whole_layers_tok_s

    @property
    def whole_layers_tok_s(self) -> float | None:
        """predicted_tok_s with every streamed layer copied whole (no hybrid split)."""
        if self.device == "cuda":
            bw = self.bandwidth_gbps
            streamed = self.bytes_per_token("pinned") + self.bytes_per_token("disk")
            links = []
            for n, link in ((self.bytes_per_token("vram"), "vram"), (streamed, "pinned"),
                            (self.bytes_per_token("disk"), "disk")):
                if n and not bw.get(link):
                    return None
                links.append(n / (bw[link] * 1e9) if n else 0.0)
            seconds = links[0] + max(links[1], links[2])
            return 1.0 / seconds if seconds else None
        parts = self.cpu_token_seconds()
        return 1.0 / parts["token"] if parts and parts["token"] else None

    def cpu_token_seconds(self) -> dict[str, float] | None:
        """Seconds of one CPU decode token by part, from the rates measured on this machine
        (memory.probes.cpu_decode_rates); None where a rate it needs was not measured.

        "compute": every layer's decode step, at the "compute" rate per resident byte (probed
          on a layer made as a streamed layer is; a resident layer, out of cache after a
          token of other layers, runs at about that rate too);
        "head": the head's matvec over head_bytes, at the "gemv" rate;
        "rebuild": making the streamed layers from the bytes read for them ("rebuild" rate per
          byte moved): views into packed images (cpu_images), or dense layers rebuilt from
          their GGUF bytes;
        "disk": reading those bytes ("disk" rate), which reader threads do ahead of use;
        "token": a token of the read-ahead ring (token_seconds_of_ring): the CPU's parts in
          series, and the waits for reads the ring could not start early enough (with
          staging_buffers buffers, a streamed layer's read starts once the layer that many
          streamed layers before it is released), so neither simply the CPU's sum nor the
          reads' where the two are close."""
        if self.device != "cpu" or self.expert_slots is not None:
            # experts read per use: how many depends on the routing, which no probe predicts
            return None
        bw = self.bandwidth_gbps
        streamed = self.bytes_per_token("disk")
        needed = ("compute", "rebuild", "disk") if streamed else ("compute",)
        if not all(bw.get(k) for k in needed):
            return None
        # the "compute" rate is per byte of what a layer decodes from: its image where every
        # layer decodes packed, its resident bytes otherwise
        computed = sum(self.file_bytes_per_layer) if self.cpu_images else \
            sum(self.resident_bytes_per_layer)
        parts = {"compute": computed / (bw["compute"] * 1e9),
                 "head": self.head_bytes / ((bw.get("gemv") or bw["compute"]) * 1e9),
                 "rebuild": streamed / (bw["rebuild"] * 1e9) if streamed else 0.0,
                 "disk": streamed / (bw["disk"] * 1e9) if streamed else 0.0}
        rate = bw["compute"] * 1e9
        layers = []  # (CPU seconds, read seconds or None) per layer, in order
        for i, t in enumerate(self.tiers):
            own = (self.file_bytes_per_layer[i] if self.cpu_images else
                   self.resident_bytes_per_layer[i]) / rate
            if t == "disk":
                b = self.file_bytes_per_layer[i]
                layers.append((own + b / (bw["rebuild"] * 1e9), b / (bw["disk"] * 1e9)))
            else:
                layers.append((own, None))
        # the store makes no more buffers than layers it reads (store.DiskLayerStore)
        buffers = max(1, min(self.staging_buffers, len(self.disk_layers)))
        parts["token"] = token_seconds_of_ring(layers, parts["head"], buffers)
        return parts

    def table(self):
        budget = f"budget {fmt_bytes(self.budget) if self.budget else 'unlimited'}"
        if self.device == "cuda":
            vram = self.budget + self.outside_allocator if self.budget else 0
            budget = (f"VRAM {fmt_bytes(vram)}, pinned RAM "
                      f"{fmt_bytes(self.ram_budget) if self.ram_budget else 'unlimited'}")
        t = Table(title=f"tier plan ({self.device}, {budget})")
        for col in ("tier", "layers", "bytes held", "bytes moved / token", "GB/s"):
            t.add_column(col, justify="right" if col != "tier" else "left")
        for tier in ("vram", "ram", "packed", "pinned", "disk"):
            idx = [i for i, x in enumerate(self.tiers) if x == tier]
            if not idx:
                continue
            if tier == "disk":
                held = (self.host_staging if self.device == "cuda" else self.staging_buffers) \
                    * max(self.file_bytes_per_layer) + self.prefill_staging
            elif tier == "pinned":
                held = sum(self.file_bytes_per_layer[i] for i in idx)
            else:
                held = sum(self.resident_bytes_per_layer[i] for i in idx)
            moved = self.bytes_per_token(tier)
            bw = self.bandwidth_gbps.get(tier)
            # the disk tier holds only its pinned staging buffers in RAM
            held_text = fmt_bytes(held) + (" staging" if tier == "disk" else "")
            t.add_row(tier, _ranges(idx), held_text, fmt_bytes(moved),
                      f"{bw:.1f}" if bw else "-")
        if self.device == "cuda" and self.streamed_layers:
            t.add_row("GPU slots", f"{self.staging_buffers} x {fmt_bytes(self.slot_bytes)}",
                      fmt_bytes(self.staging_buffers * self.slot_bytes), "-", "-")
        if self.outside_allocator:
            t.add_row("reserve", "CUDA context, kernels (outside the allocator)",
                      fmt_bytes(self.outside_allocator), "-", "-")
        if self.reserve:
            for part, n in self.reserve.items():
                if n:
                    t.add_row("reserve", part, fmt_bytes(n), "-", "-")
            if self.embed_on_host:
                t.add_row("host", "token embedding", "memory map", "1 row / token", "-")
        else:
            what = ("head, norms, KV, embedding, one cold expert" if self.expert_slots is not None
                    else "head, norms, KV")
            t.add_row("fixed", what, fmt_bytes(self.fixed_bytes), "-", "-")
        if self.expert_slots is not None:
            self._expert_rows(t)
        if self.draft is not None:
            t.add_row("draft", self.draft[0], fmt_bytes(self.draft[1]), "-", "-")
        if self.hybrid is not None:
            h = self.hybrid
            widest = ("decode only" if h.max_tokens == 1
                      else f"passes up to {h.max_tokens} tokens")
            t.add_row("hybrid CPU", f"{len(h.layers)} pinned layers: {h.cpu_share:.0%} of FFN "
                      f"units, {h.threads} threads, {widest}",
                      fmt_bytes(h.extra_ram_bytes) + " packed" if h.extra_ram_bytes
                      else "read in place",
                      fmt_bytes(h.cpu_bytes_per_token), f"{h.cpu_gbps:.1f}")
            t.add_row("hybrid PCIe", "the rest of those layers", "-",
                      fmt_bytes(h.pcie_bytes_per_token), f"{h.pcie_gbps:.1f}")
            if h.cores_stolen is not None and h.cores_stolen >= STOLEN_WARN_CORES:
                t.add_row("host", f"the hypervisor took {h.cores_stolen:.1f} cores while the "
                          f"CPU was probed: hybrid decode may run slower than predicted",
                          "-", "-", "-")
        if self.device == "cpu":
            t.caption = self._cpu_rows(t)
            return t
        tok_s = self.predicted_tok_s
        what = "link bandwidths alone"
        if self.hybrid is not None and self.hybrid.plain_tok_s:
            what = (f"PCIe and the CPU's share side by side (whole layers over PCIe: "
                    f"{self.hybrid.plain_tok_s:.2f} tok/s)")
        t.caption = (f"predicted decode from {what}: "
                     f"{tok_s:.{1 if tok_s >= 10 else 2}f} tok/s" if tok_s else None)
        return t

    def _expert_rows(self, t) -> None:
        """One row per run of layers with the same experts in VRAM, RAM and on disk (a
        48-layer model's even spread gives a few rows)."""
        assert self.expert_slots is not None
        layers = self.expert_layers or range(len(self.expert_slots))
        vram = self.vram_expert_slots or [0] * len(self.expert_slots)
        counts = {(vram[i], self.expert_slots[i]) for i in layers}
        for v, k in sorted(counts, reverse=True):
            idx = [i for i in layers if (vram[i], self.expert_slots[i]) == (v, k)]
            held = fmt_bytes(len(idx) * k * self.expert_bytes)
            if self.vram_expert_slots is None:
                where = f"{k} of {self.n_experts} in RAM, {self.n_experts - k} on disk"
            else:
                where = (f"{v} in VRAM, {k} in RAM, {self.n_experts - v - k} on disk (of "
                         f"{self.n_experts})")
                held = f"{fmt_bytes(len(idx) * v * self.expert_vram_bytes)} VRAM, {held} RAM"
            t.add_row("experts", f"{_ranges(idx)}: {where}", held,
                      f"{fmt_bytes(self.expert_read_bytes)} / cold use", "-")

    def _cpu_rows(self, t) -> str | None:
        """The CPU table's compute and rebuild rows; returns its caption (the prediction)."""
        bw = self.bandwidth_gbps
        if bw.get("compute"):
            computed = sum(self.file_bytes_per_layer) if self.cpu_images else \
                sum(self.resident_bytes_per_layer)
            t.add_row("compute", "every layer and the head, every token", "-",
                      fmt_bytes(computed + self.head_bytes), f"{bw['compute']:.2f}")
        if self.disk_layers and bw.get("rebuild"):
            t.add_row("views" if self.cpu_images else "rebuild",
                      "streamed layers' packed images, every token" if self.cpu_images else
                      "streamed layers, every token", "-",
                      fmt_bytes(self.bytes_per_token("disk")), f"{bw['rebuild']:.2f}")
        parts = self.cpu_token_seconds()
        if not parts or not parts["token"]:
            return None
        tok_s = 1.0 / parts["token"]
        ms = {k: v * 1e3 for k, v in parts.items()}
        rate = f"{ms['token']:.0f} ms/token, {tok_s:.{1 if tok_s >= 10 else 2}f} tok/s"
        if not self.disk_layers:
            return f"predicted decode: compute {rate}"
        made = "views" if self.cpu_images else "rebuild"
        return (f"predicted decode: compute {ms['compute'] + ms['head']:.0f} ms + {made} "
                f"{ms['rebuild']:.0f} ms (disk reads {ms['disk']:.0f} ms, read ahead into "
                f"{self.staging_buffers} buffers) = {rate}")


def token_seconds_of_ring(layers: list[tuple[float, float | None]], tail: float,
                          buffers: int, tokens: int = 4) -> float:
    """Seconds per token of a CPU decode loop fed by a read-ahead ring (memory.staging): each
    layer is (CPU seconds, read seconds or None where it is not read); `tail` is the CPU's
    work after the last layer (the head). Reads run one after another, in the streamed
    layers' order and cyclically over tokens, each into a buffer that the layer `buffers`
    reads before it gave back at its release; a layer's CPU work waits for its read. The
    last of `tokens` tokens is the steady state."""
    released: list[float] = []  # release time of each streamed layer, in reading order
    disk = clock = start = 0.0
    for _ in range(tokens):
        start = clock
        for cpu, read in layers:
            if read is not None:
                k = len(released)
                disk = max(disk, released[k - buffers] if k >= buffers else 0.0) + read
                clock = max(clock, disk)
                clock += cpu
                released.append(clock)
            else:
                clock += cpu
        clock += tail
    return clock - start


def evenly_spaced(items: list[int], k: int) -> list[int]:
    """k of `items` spread evenly over them (the middle of each of k equal runs)."""
    k = max(0, min(k, len(items)))
    return [items[int((j + 0.5) * len(items) / k)] for j in range(k)]


def _streamed_positions(n: int, s: int, stream_first: Collection[int] | None) -> set[int]:
    """Which s of n layers stream: evenly spaced, the last one last; with `stream_first` (the
    layers a plan at a larger budget streams), those and s - len(stream_first) more spread
    evenly over the others, so that promoting the others later gives that plan's layout."""
    first = set(stream_first) if stream_first is not None else None
    if first is not None and len(first) <= s:
        others = [i for i in range(n) if i not in first]
        return first | set(evenly_spaced(others, s - len(first)))
    return {(j + 1) * n // s - 1 for j in range(s)} if s else set()


def _interleave(vram_bytes: list[int], room: int, most: int | None = None,
                stream_first: Collection[int] | None = None) -> list[str]:
    """As many layers in VRAM as `room` holds, with the streamed ones spread evenly between
    them ("vram"/"pinned" per layer); `stream_first`: see _streamed_positions.

    Why spread: the copy of a streamed layer runs while the layers before it compute. With the
    streamed layers as one tail, the copy link idles through the resident head except for the
    K slots it can fill ahead; a prefill chunk, whose compute per layer is as long as a layer's
    copy, then pays for the resident and the streamed layers one after the other (on the H200,
    70B at 24 GiB: 0.53 s per 512 tokens against 0.38 s of copies). Spread out, each copy
    overlaps the compute before it. Decode is bound by the copies either way."""
    n = len(vram_bytes)
    count, used = 0, 0
    for b in sorted(vram_bytes):  # how many fit at most
        if used + b > room:
            break
        used, count = used + b, count + 1
    if most is not None:
        count = min(count, most)
    while count > 0:
        streamed = _streamed_positions(n, n - count, stream_first)
        if sum(b for i, b in enumerate(vram_bytes) if i not in streamed) <= room:
            return ["pinned" if i in streamed else "vram" for i in range(n)]
        count -= 1
    return ["pinned"] * n


def _ranges(idx: list[int]) -> str:
    """Layer indices for the plan table: runs with a constant step collapse ("0-9",
    "1-71 step 2"), since the CUDA planner interleaves tiers."""
    out, i = [], 0
    while i < len(idx):
        j = i + 1
        if j < len(idx):
            step = idx[j] - idx[i]
            while j + 1 < len(idx) and idx[j + 1] - idx[j] == step:
                j += 1
            if j - i >= 2 or step == 1:  # three or more, or two neighbours
                out.append(f"{idx[i]}-{idx[j]}" + (f" step {step}" if step > 1 else ""))
                i = j + 1
                continue
        out.append(str(idx[i]))
        i += 1
    return ", ".join(out)


def plan_layers(device: str, resident_bytes: list[int], file_bytes: list[int],
                fixed_bytes: int, budget: int | None, staging_buffers: int = 2,
                names: tuple[str, str] = ("ram", "disk"), prefill_staging: int = 0) -> Plan:
    """Keep layers resident (tier names[0]) in order while they fit `budget` (None: all of
    them); the rest go to the streamed tier names[1]. `prefill_staging`: bytes of staging
    held beside the `staging_buffers` buffers of file_bytes (CPU: the GGUF spans' ring where
    streamed layers decode from packed images)."""
    n = len(resident_bytes)
    staging = staging_buffers * max(file_bytes) + prefill_staging if n else 0
    if budget is None:
        return Plan(device, [names[0]] * n, resident_bytes, file_bytes, fixed_bytes, None,
                    staging_buffers, prefill_staging=prefill_staging)
    minimum = fixed_bytes + staging
    if budget < minimum:
        extra = (f" and a prefill staging buffer of {fmt_bytes(prefill_staging)}"
                 if prefill_staging else "")
        raise BudgetTooSmall(
            f"a {fmt_bytes(budget)} budget cannot run this model on {device}: it needs at least "
            f"{fmt_bytes(minimum)} (head, norms and KV cache {fmt_bytes(fixed_bytes)}, plus "
            f"{staging_buffers} staging buffers of {fmt_bytes(max(file_bytes))}{extra}); raise "
            f"the budget or lower --ctx")
    room = budget - minimum
    tiers = []
    for b in resident_bytes:
        if b <= room:
            tiers.append(names[0])
            room -= b
        else:
            tiers.append(names[1])
            room = -1  # keep the streamed layers one contiguous tail
    return Plan(device, tiers, resident_bytes, file_bytes, fixed_bytes, budget, staging_buffers,
                prefill_staging=prefill_staging)


def plan_cuda(vram_bytes: list[int], image_bytes: list[int], reserve: dict[str, int],
              vram_budget: int, ram_budget: int | None, n_slots: int = 2,
              n_staging: int = 3, io: str = "direct", vram_layers: int | None = None,
              stream_first: Collection[int] | None = None) -> Plan:
    """Layers in order: VRAM while `vram_budget` minus the reserve and the GPU slots lasts
    (and at most `vram_layers` of them, where given: the user's override, as llama.cpp's
    -ngl), then pinned RAM while `ram_budget` (None: no limit) lasts, less the disk tier's
    pinned staging buffers, then disk. stream_first: layers streamed before any other
    (_streamed_positions; a model planned beside a draft streams what it would stream
    without one, so that giving the draft up restores that layout)."""
    n = len(vram_bytes)
    fixed = sum(reserve.values())
    slot = max(image_bytes) if n else 0
    def made(tiers: list[str], host_staging: int = 0) -> Plan:
        return Plan("cuda", tiers, vram_bytes, image_bytes, fixed, vram_budget, n_slots,
                    ram_budget=ram_budget, host_staging=host_staging, reserve=dict(reserve),
                    io=io, vram_layers=vram_layers)

    if fixed + sum(vram_bytes) <= vram_budget and (vram_layers is None or vram_layers >= n):
        return made(["vram"] * n)
    # the mmap baseline copies its layers into one more slot of its own
    slots = n_slots + (1 if io == "mmap" else 0)
    minimum = fixed + slots * slot
    if vram_budget < minimum:
        raise BudgetTooSmall(
            f"a {fmt_bytes(vram_budget)} VRAM budget cannot run this model on cuda: it needs "
            f"at least {fmt_bytes(minimum)} (reserve {fmt_bytes(fixed)}: "
            + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in reserve.items())
            + f"; plus {slots} GPU slots of {fmt_bytes(slot)}); raise --vram-budget or lower "
              f"--ctx")
    tiers = _interleave(vram_bytes, vram_budget - minimum, vram_layers, stream_first)
    streamed = [i for i, t in enumerate(tiers) if t == "pinned"]
    host_staging = 0
    if ram_budget is not None and sum(image_bytes[i] for i in streamed) > ram_budget:
        # the disk tier's pinned staging buffers come out of the RAM budget (kvikio and mmap
        # bring their own)
        host_staging = n_staging if io in ("direct", "buffered") else 0
        if ram_budget < host_staging * slot:
            raise BudgetTooSmall(
                f"a {fmt_bytes(ram_budget)} RAM budget cannot stream this model from disk: its "
                f"{host_staging} pinned staging buffers alone take "
                f"{fmt_bytes(host_staging * slot)}; raise --ram-budget")
        room = ram_budget - host_staging * slot
        for i in streamed:
            if image_bytes[i] <= room:
                room -= image_bytes[i]
            else:
                tiers[i] = "disk"
                room = -1
    return made(tiers, host_staging)
