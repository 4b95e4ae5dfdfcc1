"""The tier plan: which layers stay resident, which stream from disk each token.

On CPU "resident" means dequantized in RAM (tier B's role); the rest is read from the GGUF file
on every token (tier C). Layers are placed in order: earlier layers resident, the tail streamed,
so the reader can prefetch the streamed run sequentially. The plan also predicts decode speed
from bandwidths measured at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BudgetTooSmall
from .budget import fmt_bytes


@dataclass
class Plan:
    device: str
    tiers: list[str]  # per layer: "ram"/"disk" on CPU; "vram"/"pinned" on CUDA
    resident_bytes_per_layer: list[int]  # memory a resident layer takes
    file_bytes_per_layer: list[int]  # bytes read from disk when a layer streams
    fixed_bytes: int  # head, norms, KV cache, staging buffers: needed whatever the plan
    budget: int | None
    staging_buffers: int
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)  # "ram", "disk"

    @property
    def disk_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == "disk"]

    @property
    def streamed_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t in ("disk", "pinned")]

    def bytes_per_token(self, tier: str) -> int:
        if tier == "disk":
            return sum(self.file_bytes_per_layer[i] for i in self.disk_layers)
        return sum(b for b, t in zip(self.resident_bytes_per_layer, self.tiers) if t == tier)

    @property
    def predicted_tok_s(self) -> float | None:
        """Decode rate if every link ran at its measured bandwidth, one after another."""
        seconds = 0.0
        for tier in ("vram", "ram", "pinned", "disk"):
            bw = self.bandwidth_gbps.get(tier)
            n = self.bytes_per_token(tier)
            if n and not bw:
                return None
            if n:
                seconds += n / (bw * 1e9)
        return 1.0 / seconds if seconds else None

    def table(self):
        from rich.table import Table

        t = Table(title=f"tier plan ({self.device}, budget "
                        f"{fmt_bytes(self.budget) if self.budget else 'unlimited'})")
        for col in ("tier", "layers", "bytes held", "bytes moved / token", "GB/s"):
            t.add_column(col, justify="right" if col != "tier" else "left")
        for tier in ("vram", "ram", "pinned", "disk"):
            idx = [i for i, x in enumerate(self.tiers) if x == tier]
            if not idx:
                continue
            held = sum(self.resident_bytes_per_layer[i] for i in idx) if tier != "disk" else \
                self.staging_buffers * max(self.file_bytes_per_layer)
            moved = self.bytes_per_token(tier)
            bw = self.bandwidth_gbps.get(tier)
            t.add_row(tier, _ranges(idx), fmt_bytes(held), fmt_bytes(moved),
                      f"{bw:.1f}" if bw else "-")
        t.add_row("fixed", "head, norms, KV", fmt_bytes(self.fixed_bytes), "-", "-")
        tok_s = self.predicted_tok_s
        t.caption = (f"predicted decode from link bandwidths alone: {tok_s:.1f} tok/s"
                     + (" (CPU streaming also pays to dequantize each streamed layer)"
                        if self.device == "cpu" and self.disk_layers else "")) if tok_s else None
        return t


def _ranges(idx: list[int]) -> str:
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def plan_layers(device: str, resident_bytes: list[int], file_bytes: list[int],
                fixed_bytes: int, budget: int | None, staging_buffers: int = 2,
                names: tuple[str, str] = ("ram", "disk")) -> Plan:
    """Keep layers resident (tier names[0]) in order while they fit `budget` (None: all of
    them); the rest go to the streamed tier names[1]."""
    n = len(resident_bytes)
    staging = staging_buffers * max(file_bytes) if n else 0
    if budget is None:
        return Plan(device, [names[0]] * n, resident_bytes, file_bytes, fixed_bytes, None,
                    staging_buffers)
    minimum = fixed_bytes + staging
    if budget < minimum:
        raise BudgetTooSmall(
            f"a {fmt_bytes(budget)} budget cannot run this model on {device}: it needs at least "
            f"{fmt_bytes(minimum)} (head, norms and KV cache {fmt_bytes(fixed_bytes)}, plus "
            f"{staging_buffers} staging buffers of {fmt_bytes(max(file_bytes))}); raise the "
            f"budget or lower --ctx")
    room = budget - minimum
    tiers = []
    for b in resident_bytes:
        if b <= room:
            tiers.append(names[0])
            room -= b
        else:
            tiers.append(names[1])
            room = -1  # keep the streamed layers one contiguous tail
    return Plan(device, tiers, resident_bytes, file_bytes, fixed_bytes, budget, staging_buffers)
