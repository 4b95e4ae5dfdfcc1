"""Hybrid decode's running balance (memory.hybrid_balance): how many split layers the CPU keeps
as its measured rate changes. Figures shaped like the H200's 70B at 24 GiB: 36 split layers,
each with 0.232 GB of packed CPU weights, a 0.28 GB GPU prefix and a 0.495 GB whole image
(bench/results/2026-12-03-s22-hybrid-bench-h200-call2.json)."""

from __future__ import annotations

import pytest

from slipstream.memory.hybrid_balance import (MIN_GAIN, HybridBalance, SplitLayer, best_count,
                                              token_seconds)
from slipstream.memory.planner import evenly_spaced

GB = 10**9
PCIE = 55.0


def seventy_layers(n: int = 36) -> dict[int, SplitLayer]:
    # the pinned layers of an 80-layer plan, spread as the planner spreads them
    return {i: SplitLayer(int(0.232 * GB), int(0.28 * GB), int(0.495 * GB))
            for i in evenly_spaced(list(range(80)), n)}


def cpu_and_pcie(layers, active, cpu_gbps):
    cpu = sum(layers[i].cpu_bytes for i in active) / (cpu_gbps * GB)
    pcie = sum(s.prefix_bytes if i in active else s.image_bytes
               for i, s in layers.items()) / (PCIE * GB)
    return cpu, pcie


def test_a_cpu_at_its_probed_rate_keeps_every_split_layer():
    layers = seventy_layers()
    # 36 x 0.232 GB at 57 GB/s is 147 ms, under PCIe's 183 ms: taking a layer off the CPU
    # only adds its rest to PCIe
    assert best_count(layers, 0, 57.0, PCIE) == 36


def test_a_slow_cpu_gives_layers_back_until_both_sides_meet():
    layers = seventy_layers()
    k = best_count(layers, 0, 34.4, PCIE)
    # cpu(k) = 6.74 ms x k against pcie(k) = 324 - 3.91 k ms: they cross at k = 30.4
    assert k in (30, 31)
    active = set(evenly_spaced(sorted(layers), k))
    cpu, pcie = cpu_and_pcie(layers, active, 34.4)
    assert abs(cpu - pcie) < 0.232 * GB / (34.4 * GB) + 0.215 * GB / (PCIE * GB)
    everyone = token_seconds(layers, set(layers), 0, 34.4, PCIE)
    assert token_seconds(layers, active, 0, 34.4, PCIE) < 0.9 * everyone  # 207 ms vs 243


def test_the_count_never_drops_below_one_layer():
    assert best_count(seventy_layers(), 0, 1e-3, PCIE) == 1


def test_other_streamed_bytes_make_pcie_the_slower_side():
    layers = seventy_layers()
    slow = best_count(layers, 0, 34.4, PCIE)
    # 20 GB more of whole layers on the link: PCIe is far behind, the CPU keeps everything
    assert best_count(layers, 20 * GB, 34.4, PCIE) == 36 > slow


def _feed(balance: HybridBalance, gbps: float, passes: int, state: list[float]):
    """`passes` decode passes at the CPU rate `gbps` (the store's running totals in state)."""
    out = []
    for _ in range(passes):
        nbytes = sum(balance.layers[i].cpu_bytes for i in balance.active)
        state[0] += nbytes / (gbps * GB)
        state[1] += nbytes
        out.append(balance.observe(state[0], int(state[1])))
    return out


def test_observe_changes_after_two_windows_agree_and_follows_the_cpu_both_ways():
    balance = HybridBalance(seventy_layers(), 0, PCIE, window=4)
    state = [0.0, 0.0]
    first = _feed(balance, 34.4, 9, state)
    # the first pass sets the mark; each window's fourth pass after it judges; the change
    # waits for the second window to call for it too
    assert first[:8] == [None] * 8 and first[8] is not None
    assert len(balance.active) in (30, 31) and balance.active <= set(balance.layers)
    assert balance.cpu_gbps == pytest.approx(34.4)
    assert balance.changes == [(9, len(balance.active), 34.4)]
    # the CPU recovers: two windows later every layer is back
    back = _feed(balance, 57.0, 8, state)
    assert back[:7] == [None] * 7 and back[7] == set(balance.layers)
    assert len(balance.changes) == 2


def test_one_window_out_of_line_changes_nothing():
    balance = HybridBalance(seventy_layers(), 0, PCIE, window=4)
    state = [0.0, 0.0]
    # a slow first window (a load's warm-up), then the CPU at its probed rate
    out = _feed(balance, 34.4, 5, state) + _feed(balance, 57.0, 8, state)
    assert out == [None] * 13 and not balance.changes
    assert balance.active == set(balance.layers)


def test_a_change_must_promise_its_minimum_gain():
    layers = seventy_layers()
    # a rate at which giving back layers gains under MIN_GAIN
    rate = next(r / 10 for r in range(570, 300, -1)
                if 0 < 1 - token_seconds(layers, set(evenly_spaced(sorted(layers),
                                                                   best_count(layers, 0, r / 10,
                                                                              PCIE))),
                                         0, r / 10, PCIE)
                / token_seconds(layers, set(layers), 0, r / 10, PCIE) < MIN_GAIN)
    balance = HybridBalance(layers, 0, PCIE, window=1)
    state = [0.0, 0.0]
    assert _feed(balance, rate, 4, state) == [None] * 4
    assert balance.active == set(layers) and not balance.changes


def test_a_reset_of_the_store_counters_is_skipped_not_misread():
    balance = HybridBalance(seventy_layers(), 0, PCIE, window=1)
    assert balance.observe(10.0, 10 * GB) is None  # the mark
    assert balance.observe(0.1, GB // 100) is None  # counters went back (stats.reset())
    assert balance.cpu_gbps is None and balance.active == set(balance.layers)


def test_forgotten_layers_leave_the_balance():
    layers = seventy_layers()
    balance = HybridBalance(layers, 0, PCIE)
    gone = sorted(layers)[:5]
    balance.forget(gone)
    assert not set(gone) & (set(balance.layers) | balance.active)
    assert len(balance.active) == 31
