"""The default thread count: physical cores less what other processes use, and OpenMP threads
that sleep rather than spin while they wait."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.threads import (CpuSample, affinity, cpu_ticks, free_threads,
                                        physical_cores)

STAT = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 400 0 0 0 0 0 0
cpu1 30 5 15 400 50 0 0 0 0 0
intr 12345
"""


def test_cpu_ticks_counts_idle_and_iowait_as_free(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert cpu_ticks([0, 1], stat) == {0: (100, 500), 1: (50, 500)}
    assert cpu_ticks([1], stat) == {1: (50, 500)}
    assert cpu_ticks([0], tmp_path / "missing") == {}


def test_physical_cores_counts_smt_siblings_once(tmp_path):
    for cpu, core in [(0, 0), (1, 1), (2, 0), (3, 1)]:  # two cores, two threads each
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1
    assert physical_cores([0, 1, 7], tmp_path) == 3  # cpu7 unreadable: the CPUs counted


@pytest.mark.parametrize("busy, expected", [(None, 2), (0.0, 2), (0.4, 2), (0.6, 1),
                                            (1.0, 1), (1.9, 1), (3.0, 1)])
def test_free_threads_is_the_cores_others_leave(busy, expected):
    assert free_threads(busy, cpus=[0, 1], cores=2) == expected


def test_free_threads_never_exceeds_physical_cores():
    assert free_threads(0.0, cpus=[0, 1, 2, 3], cores=2) == 2


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")
def test_a_competing_process_counts_as_busy_and_our_own_work_does_not():
    cpus = affinity()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time
        time.sleep(0.1)  # the child is up and spinning
        sample = CpuSample.start(cpus)
        end = time.monotonic() + 0.4
        while time.monotonic() < end:  # our own work in the window: subtracted
            pass
        busy = sample.busy_cores()
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and busy >= 0.6  # the spinning child's core, at least
    assert busy <= len(cpus)
    assert free_threads(busy, cpus) <= max(1, len(cpus) - 1)


def test_a_window_too_short_measures_nothing():
    assert CpuSample.start().busy_cores() is None


@pytest.mark.parametrize("env, expected", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"},
                                                              "ACTIVE")])
def test_openmp_threads_wait_passively_unless_told(env, expected):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", "import slipstream, os; "
                          "print(os.environ['OMP_WAIT_POLICY'])"], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from slipstream.synth import write_synth

    return write_synth(tmp_path_factory.mktemp("threads") / "m.gguf", "tiny", "Q4_K_M",
                       n_layers=2)


@pytest.mark.parametrize("given", [None, 2])
def test_load_sets_the_free_cores_unless_a_count_is_given(tiny_model, monkeypatch, given):
    import torch

    import slipstream
    from slipstream import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # another process holds every CPU but a fraction of one
    monkeypatch.setattr(threads.CpuSample, "busy_cores", lambda self: len(self.cpus) - 0.2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = slipstream.load(tiny_model, device="cpu", ctx=32,
                            placement=slipstream.Placement(threads=given))
        m.close()
        assert torch.get_num_threads() == (1 if given is None else 2)
    finally:
        torch.set_num_threads(before)
