"""The part of a VRAM budget kept for what the driver counts outside torch's allocator
(memory.cuda_context), with torch.cuda's two calls faked; the GPU side (the driver's count
under the budget) is tests/gpu/test_tier_c_gpu.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.memory import cuda_context
from slipstream.memory.planner import plan_cuda

GIB = 1 << 30
MIB = 1 << 20


def _device(monkeypatch, used: int, reserved: int, total: int = 80 * GIB) -> torch.device:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(cuda_context, "_measured", {})
    return torch.device("cuda", 0)


def test_a_context_larger_than_the_floor_is_kept_whole(monkeypatch):
    dev = _device(monkeypatch, used=3 * GIB + 900 * MIB, reserved=2 * GIB)
    assert cuda_context.outside_allocator_bytes(dev) == GIB + 900 * MIB


def test_a_young_context_is_counted_at_the_floor(monkeypatch):
    # at plan time the context has not loaded its kernels yet: it grows to about the floor
    dev = _device(monkeypatch, used=GIB + 300 * MIB, reserved=GIB)
    assert cuda_context.outside_allocator_bytes(dev) == cuda_context.CONTEXT_FLOOR


def test_other_processes_memory_is_not_taken_for_the_context(monkeypatch):
    dev = _device(monkeypatch, used=40 * GIB, reserved=GIB)  # a neighbour holds 38 GiB
    assert cuda_context.outside_allocator_bytes(dev) == cuda_context.CONTEXT_FLOOR


def test_it_is_measured_once_per_process(monkeypatch):
    """Every budget of a process (a draft's, its model's, a test's) is cut by the same bytes,
    though the context grows as kernels load."""
    dev = _device(monkeypatch, used=3 * GIB, reserved=GIB)
    first = cuda_context.outside_allocator_bytes(dev)
    _device_grown = lambda device=None: (80 * GIB - 4 * GIB, 80 * GIB)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "mem_get_info", _device_grown)
    assert cuda_context.outside_allocator_bytes(dev) == first == 2 * GIB


def test_the_plan_table_shows_the_whole_budget_and_the_context_row():
    plan = plan_cuda([GIB] * 4, [GIB] * 4, {"KV cache": GIB}, 3 * GIB, None)
    plan = dataclasses.replace(plan, outside_allocator=cuda_context.CONTEXT_FLOOR)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan.table())
    text = console.export_text()
    assert "CUDA context" in text
    budget = plan.budget + cuda_context.CONTEXT_FLOOR
    from slipstream.memory.budget import fmt_bytes

    assert f"VRAM {fmt_bytes(budget)}" in text


def test_load_gives_the_allocator_the_budget_less_the_context(monkeypatch):
    from slipstream.errors import BudgetTooSmall
    from slipstream.runtime import build

    dev = _device(monkeypatch, used=GIB + 300 * MIB, reserved=GIB)  # the floor applies
    floor = cuda_context.CONTEXT_FLOOR
    assert build.allocator_budget(24 * GIB, dev) == (24 * GIB - floor, floor)
    assert build.allocator_budget(None, dev) == (None, 0)  # no budget: what is free
    assert build.allocator_budget(GIB, torch.device("cpu")) == (GIB, 0)
    with pytest.raises(BudgetTooSmall, match="does not cover the CUDA context"):
        build.allocator_budget(floor, dev)
