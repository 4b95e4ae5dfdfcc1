"""How many threads the CPU's matmuls get by default: one per physical core this process may
run on, with OpenMP's threads waiting passively (slipstream/__init__.py sets OMP_WAIT_POLICY).

torch's default is one thread per CPU, SMT siblings included, and libgomp's threads spin while
they wait. On a 2-core machine shared with other CPU-bound processes (load average 5-6), the
default model decoded at 2.5-7.4 tok/s with 2 spinning threads, against 70-80 with one: each
spinning thread took the core the working one needed. With the threads waiting passively, 2
threads beat 1 under the same load, round after round (88.6 / 114.7 / 71.5 tok/s against
52.2 / 45.7 / 50.3, benchmarks/cpu.py threads): the scheduler gives each runnable thread its
share, and a waiting thread no longer burns one. Counting the cores other processes were using
(sampled from /proc/stat during the load) and taking only the rest was measured too, and lost:
1 thread, 25.6-40.3 tok/s in the same rounds. So the default is the physical cores, and the
cores' business is the scheduler's.

An explicit `-t` / Placement(threads=...) or OMP_NUM_THREADS is never overridden.
"""

from __future__ import annotations

import os
from pathlib import Path


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct (package, core) pairs among `cpus` (SMT siblings share a core's execution
    units and its bandwidth to memory, which a decode matvec is bound by); len(cpus) where the
    topology is unreadable (not Linux)."""
    cores = set()
    for c in cpus:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def default_threads() -> int:
    """The CPU engine's thread count where none is given: the physical cores of the affinity
    set."""
    return physical_cores(affinity())


def threads_given() -> bool:
    """Whether the environment names a thread count (OMP_NUM_THREADS: torch's default
    follows it, and so does ours)."""
    return bool(os.environ.get("OMP_NUM_THREADS"))
