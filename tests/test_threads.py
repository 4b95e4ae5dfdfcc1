"""The default thread count (one per physical core) and OpenMP threads that sleep rather than
spin while they wait."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.threads import affinity, default_threads, physical_cores


def test_physical_cores_counts_smt_siblings_once(tmp_path):
    for cpu, core in [(0, 0), (1, 1), (2, 0), (3, 1)]:  # two cores, two threads each
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1
    assert physical_cores([0, 1, 7], tmp_path) == 3  # cpu7 unreadable: the CPUs counted


def test_default_is_this_machines_physical_cores():
    n = default_threads()
    assert n == physical_cores(affinity())
    assert 1 <= n <= len(affinity())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from slipstream.synth import write_synth

    return write_synth(tmp_path_factory.mktemp("threads") / "m.gguf", "tiny", "Q4_K_M",
                       n_layers=2)


@pytest.mark.parametrize("given, env, expected", [(None, None, 3), (2, None, 2),
                                                  (None, "2", 2)])
def test_load_sets_the_default_unless_a_count_is_given(tiny_model, monkeypatch, given, env,
                                                       expected):
    import torch

    import slipstream
    from slipstream.runtime import build

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if env is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(build, "default_threads", lambda: 3)  # a machine of 3 cores
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = slipstream.load(tiny_model, device="cpu", ctx=32,
                            placement=slipstream.Placement(threads=given))
        m.close()
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


# a machine with an NVIDIA GPU keeps libgomp's default (hybrid decode was measured with it)
GPU_HOST = os.path.exists("/dev/nvidiactl")


@pytest.mark.parametrize("env, expected", [({}, None if GPU_HOST else "PASSIVE"),
                                           ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")])
def test_openmp_threads_wait_passively_unless_told(env, expected):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", "import slipstream, os; "
                          "print(os.environ.get('OMP_WAIT_POLICY'))"], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)
