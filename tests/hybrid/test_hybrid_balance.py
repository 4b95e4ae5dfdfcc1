"""Hybrid decode's running balance (hybrid.balance): how many split layers the CPU keeps
as its measured rate changes. Figures shaped like the H200's 70B at 24 GiB: 36 split layers,
each with 0.232 GB of packed CPU weights, a 0.28 GB GPU prefix and a 0.495 GB whole image."""

from __future__ import annotations

import pytest

from slipstream.hybrid.balance import (MIN_GAIN, HybridBalance, SplitLayer, best_count,
                                              token_seconds)
from slipstream.memory.planner import evenly_spaced
from slipstream.hybrid.plan import HANDOVER_S

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
    assert balance.changes == [(9, len(balance.active), 34.4, PCIE)]
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


# The H200's 70B at 24 GiB: 36 split layers of 0.495 GB images whose FFN holds 0.396 GB, the CPU's layout 1.33
# bytes per GGUF byte; decode measured the CPU at 67.9 GB/s and the copies at 43.6, where the
# plan's probe had said 49.4. Here each share is 0.69 and the balance has 29 of the 36 layers
# split (as after taking some off a CPU that was slow for a while).
S31_FFN, S31_IMAGE, S31_RATIO, S31_PACKED = 0.396, 0.495, 1.33, 0.69


def s31_layers() -> dict[int, SplitLayer]:
    cpu = int(S31_PACKED * S31_FFN * S31_RATIO * GB)
    prefix = int((S31_IMAGE - S31_PACKED * S31_FFN) * GB)
    return {i: SplitLayer(cpu, prefix, int(S31_IMAGE * GB))
            for i in evenly_spaced(list(range(80)), 36)}


def _feed_both(balance: HybridBalance, cpu_gbps: float, pcie_gbps: float, passes: int,
               state: list[float]):
    """Decode passes with the CPU and the copies at these rates (the store's running totals
    of both in state: cpu seconds, cpu bytes, copy seconds, copy bytes)."""
    out = []
    for _ in range(passes):
        layers = balance.layers
        cpu = sum(layers[i].cpu_bytes for i in balance.active)
        copied = balance.other_bytes + sum(s.prefix_bytes if i in balance.active
                                           else s.image_bytes for i, s in layers.items())
        state[0] += cpu / (cpu_gbps * GB)
        state[1] += cpu
        state[2] += copied / (pcie_gbps * GB)
        state[3] += copied
        out.append(balance.observe(state[0], int(state[1]), state[2], int(state[3])))
    return out


def test_the_handover_counts_on_the_cpus_side():
    layers = seventy_layers()
    active = set(evenly_spaced(sorted(layers), 10))
    bare = token_seconds(layers, active, 40 * GB, 57.0, PCIE)
    assert bare == pytest.approx((40 + 10 * 0.28 + 26 * 0.495) / PCIE)  # PCIe's side
    slow = token_seconds(layers, set(layers), 0, 20.0, PCIE, layer_s=1e-3)
    assert slow == pytest.approx(36 * 0.232 / 20.0 + 36 * 1e-3)  # the CPU's side
    # a large enough hand-over takes layers off the CPU that its bytes alone would keep
    assert best_count(layers, 0, 57.0, PCIE, layer_s=5e-3) < best_count(layers, 0, 57.0, PCIE)


def test_a_cpu_with_time_to_spare_takes_more_layers_judged_by_the_copies_measured():
    layers = s31_layers()
    start = set(evenly_spaced(sorted(layers), 29))
    handover = 0.55e-3
    # judged by the probe alone, the CPU gets a few layers more
    by_probe = best_count(layers, 0, 67.9, 49.4, handover)
    # the copies measured slower than probed: the CPU should take more of the work
    measured = best_count(layers, 0, 67.9, 43.6, handover)
    assert 29 < by_probe < measured <= 36
    balance = HybridBalance(layers, 0, 49.4, active=set(start), window=4, layer_s=handover)
    state = [0.0] * 4
    out = _feed_both(balance, 67.9, 43.6, 9, state)
    assert out[:8] == [None] * 8 and out[8] == balance.active
    assert len(balance.active) == measured
    assert balance.pcie_measured == pytest.approx(43.6)
    assert balance.changes == [(9, measured, 67.9, 43.6)]
    before = token_seconds(layers, start, 0, 67.9, 43.6, handover)
    after = token_seconds(layers, balance.active, 0, 67.9, 43.6, handover)
    assert after < 0.93 * before  # 227 ms a token at 29 layers, about 201 at the count chosen


def test_without_copies_measured_the_probe_judges_pcie():
    layers = s31_layers()
    balance = HybridBalance(layers, 0, 49.4, active=set(evenly_spaced(sorted(layers), 29)),
                            window=4, layer_s=0.55e-3)
    _feed(balance, 67.9, 9, [0.0, 0.0])
    assert balance.pcie_measured is None
    assert balance.changes and balance.changes[-1][3] == 49.4
    assert len(balance.active) == best_count(layers, 0, 67.9, 49.4, 0.55e-3)


# Two runs on an H200 host: the 70B at 24 GiB, 36 of 80 layers streamed and split, run with every split
# layer's CPU share at 0.54 (198.6 ms a token measured) and with 28 of them at 0.73, the other
# 8 copied whole (233.2 ms), about the same bytes each way in all. Per split layer: the CPU's
# packed bytes and the prefix copied, from the runs' per-token figures; images of 0.495 GB.
def h200_ring(n_split: int, cpu_gb: float, prefix_gb: float):
    streamed = evenly_spaced(list(range(80)), 36)
    ring = [(i, int(0.495 * GB) if i in streamed else 0) for i in range(80)]
    layers = {i: SplitLayer(int(cpu_gb * GB), int(prefix_gb * GB), int(0.495 * GB))
              for i in streamed}
    return ring, layers, set(evenly_spaced(streamed, n_split))


def test_the_ring_model_tells_heavier_split_layers_apart_where_totals_do_not():
    from slipstream.hybrid.balance import pipeline_seconds

    even = h200_ring(36, 10.362 / 36, 9.823 / 36)
    heavy = h200_ring(28, 10.834 / 28, 0.205)
    handover = HANDOVER_S
    ring_even = pipeline_seconds(*even, 68.5, 53.1, handover)
    ring_heavy = pipeline_seconds(*heavy, 65.9, 51.1, handover)
    assert ring_even == pytest.approx(0.1986, rel=0.08)  # measured 198.6 ms
    assert ring_heavy == pytest.approx(0.2332, rel=0.08)  # measured 233.2 ms
    assert ring_heavy > 1.15 * ring_even
    # the totals see about the same token both ways (the CPU's and PCIe's sums barely move)
    totals = [token_seconds(layers, active, 0, cpu, pcie, handover)
              for (_, layers, active), cpu, pcie in ((even, 68.5, 53.1), (heavy, 65.9, 51.1))]
    assert abs(totals[1] / totals[0] - 1) < 0.05


def test_the_ring_model_gives_the_traced_token():
    """A traced run on an H100 host: the same layout with every split layer at a 0.598 share, the CPU reading
    11.381 GB a token at 68.7 GB/s and the copies 9.037 GB at 53.9: 188.9 ms a token, of
    which the CPU's shares took 168.6 ms and the resident layers' GPU 14.5. Here the chain
    binds, not the copies."""
    from slipstream.hybrid.balance import pipeline_seconds

    ring, layers, active = h200_ring(36, 11.381 / 36, 9.037 / 36)
    token = pipeline_seconds(ring, layers, active, 68.7, 53.9, HANDOVER_S)
    assert token == pytest.approx(0.1889, rel=0.03)
    copies = sum(s.prefix_bytes for s in layers.values()) / 53.9e9
    assert token > copies * 1.05


def test_the_ring_model_is_the_copies_where_nothing_is_split():
    from slipstream.hybrid.balance import pipeline_seconds

    ring = [(i, 500 * 10**6 if i % 2 else 0) for i in range(10)]  # 5 streamed, 5 resident
    whole = pipeline_seconds(ring, {}, set(), 50.0, 50.0, gpu_s=1e-4)
    assert whole == pytest.approx(5 * 0.01, rel=0.02)  # bound by the copies: 10 ms each
    # one slot: each copy waits for the compute of the streamed layer before it, and overlaps
    # only the resident layer's between them (5 ms under its 10)
    slow_gpu = pipeline_seconds(ring, {}, set(), 50.0, 50.0, slots=1, gpu_s=5e-3)
    assert slow_gpu == pytest.approx(5 * (0.01 + 5e-3), rel=0.02)
    two = pipeline_seconds(ring, {}, set(), 50.0, 50.0, slots=2, gpu_s=5e-3)
    assert two == pytest.approx(5 * 0.01, rel=0.02)  # copies back to back, compute under them


def test_with_its_ring_the_balance_judges_by_it():
    ring, layers, _ = h200_ring(36, 10.362 / 36, 9.823 / 36)
    balance = HybridBalance(dict(layers), 0, 53.1, window=2, layer_s=0.55e-3, ring=ring)
    state = [0.0] * 4
    _feed_both(balance, 20.0, 53.1, 5, state)  # a CPU at a third of its rate
    assert balance.changes and len(balance.active) < 36
    k = len(balance.active)
    assert k == best_count(layers, 0, 20.0, 53.1, 0.55e-3, ring=ring)
    assert k != best_count(layers, 0, 20.0, 53.1, 0.55e-3)  # the totals would choose otherwise


def test_the_store_gives_the_balance_its_pass_in_order():
    """CudaLayerStore._ring_layout: every layer a pass runs, resident ones at 0 bytes, the
    streamed ones at their whole image, skipped ones left out."""
    from types import SimpleNamespace

    from slipstream.memory.cuda_store import CudaLayerStore

    store = SimpleNamespace(layers=["r", None, "r", None, None], skipped=frozenset({3}),
                            feed={1: "ring", 3: "ring", 4: "ring"},
                            layouts={i: SimpleNamespace(nbytes=100 * i) for i in (1, 3, 4)})
    assert CudaLayerStore._ring_layout(store) == [(0, 0), (1, 100), (2, 0), (4, 400)]


def test_the_cli_says_where_the_balance_moved_the_split(capsys):
    """--stats' note after a generation whose split the balance changed: layers kept split and
    both rates it judged by (cli._print_balance)."""
    from types import SimpleNamespace

    from slipstream.cli.render import print_balance as _print_balance

    balance = HybridBalance(seventy_layers(), 0, PCIE, window=1)
    store = SimpleNamespace(balance=balance, active=set(), hosts=balance.layers)
    _print_balance(store)
    assert capsys.readouterr().err == ""  # no change made: nothing to say
    state = [0.0] * 4
    _feed_both(balance, 20.0, 41.5, 3, state)
    store.active = balance.active
    _print_balance(store)
    err = " ".join(capsys.readouterr().err.split())
    assert f"computes {len(balance.active)} of 36 split layers" in err
    assert "20.0 GB/s, the copies 41.5" in err and "changed 1 times" in err
