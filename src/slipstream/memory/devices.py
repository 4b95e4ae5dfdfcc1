"""The devices a model's stages run on: the user's list checked, a budget for each, and the
layers split into contiguous ranges, one range per stage.

A stage is a device and a range of layers with their own KV cache (runtime.stage); the engine
chains the stages and moves the hidden state across each boundary. The first stage holds the
token embedding, the last one the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..errors import BadArgument, DeviceNotFound


def resolve_device(name: str | torch.device) -> torch.device:
    """A device name ("auto", "cpu", "cuda", "cuda:N") as the torch.device it means here; one
    this machine lacks raises DeviceNotFound, saying what it has."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise BadArgument(f"device {name!r} is not a device name ({e})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceNotFound(f"device {str(name)!r} is not supported; use cpu, cuda[:N] or auto")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if dev.index is None else dev.index
    if not count:
        raise DeviceNotFound(f"cuda:{index} does not exist: CUDA is not available on this "
                             f"machine; use --device cpu")
    if index >= count:
        raise DeviceNotFound(f"cuda:{index} does not exist: this machine has {count} CUDA "
                             f"device(s); name GPUs 0..{count - 1}")
    return dev


def resolve_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    """Each stage's device (resolve_device); each CUDA one with its index."""
    if isinstance(devices, (str, torch.device)) or not devices:
        raise BadArgument(f"devices={devices!r}: give a list of devices, e.g. "
                          f"['cuda:0', 'cuda:1'] or ['cpu', 'cpu']")
    out = []
    for name in devices:
        dev = resolve_device(name)
        out.append(torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev)
    return out


def per_device_budgets(budget, n_devices: int) -> list:
    """One budget a device: a single budget applies to each, a list (or "24GiB,12GiB") sets
    them one by one and must name as many as there are devices."""
    if isinstance(budget, (list, tuple)):
        parts = list(budget)
    elif isinstance(budget, str) and "," in budget:
        parts = [p.strip() for p in budget.split(",")]
    else:
        return [budget] * n_devices
    if len(parts) != n_devices:
        raise BadArgument(f"{len(parts)} VRAM budgets ({', '.join(map(str, parts))}) for "
                          f"{n_devices} devices: give one budget for all, or one per device")
    return parts


def stage_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous ranges of layers, as even as the count allows (the first ones one longer)."""
    if not 1 <= n_stages <= n_layers:
        raise BadArgument(f"{n_stages} stages for a model of {n_layers} layers: each stage "
                          f"needs at least one layer")
    size, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for k in range(n_stages):
        end = start + size + (k < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


REMOTE = "remote"  # a pipeline's tier for the layers another process holds


def pad_stage_plan(plan, stage, n_layers: int):
    """A stage's plan (per-layer lists indexed from its first layer) indexed by layer instead:
    the other stages' layers get the tier REMOTE and no bytes, so that nothing of them is
    loaded, pinned or streamed here, and every tier sum counts this stage's layers only."""
    before, after = stage.layers.start, n_layers - stage.layers.stop
    if len(plan.tiers) != len(stage.layers):
        raise ValueError(f"the plan has {len(plan.tiers)} layers, the stage "
                         f"{len(stage.layers)}")
    def pad(values: list, fill) -> list:
        return [fill] * before + list(values) + [fill] * after

    return replace(plan, tiers=pad(plan.tiers, REMOTE), stages=[stage],
                   resident_bytes_per_layer=pad(plan.resident_bytes_per_layer, 0),
                   file_bytes_per_layer=pad(plan.file_bytes_per_layer, 0))
