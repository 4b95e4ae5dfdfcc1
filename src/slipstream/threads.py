"""How many threads the CPU's matmuls get by default: the physical cores this process may run on
that other processes are not already using.

torch's default is every CPU, and its OpenMP threads meet at a barrier after each op: where a
competing process holds one of two cores, each region waits for the thread that is not running.
Measured on a 2-core machine with the default model and another CPU-bound process: decode at
9.6 tok/s with torch's 2 threads, 98 with one. So the default counts what the other processes
use, sampled from /proc/stat over a window in which this process also works (the load), less
this process's own CPU time over the same window (os.times: it is no competitor), and takes the
physical cores left, at least one. Where /proc/stat or the topology cannot be read (not Linux),
it is the physical cores (or CPUs) of the affinity set.

An explicit `-t` / Placement(threads=...) is never overridden.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# below this window the /proc/stat counters (10 ms ticks) say too little to act on: the
# default is then the free cores of the last window, or all physical cores
MIN_WINDOW_S = 0.05


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct (package, core) pairs among `cpus` (SMT siblings share a core's execution
    units: a second thread on one adds little to a memory-bound matvec); len(cpus) where the
    topology is unreadable."""
    cores = set()
    for c in cpus:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def cpu_ticks(cpus: list[int], stat: Path = Path("/proc/stat")) -> dict[int, tuple[int, int]]:
    """cpu -> (busy ticks, all ticks) from /proc/stat, for the CPUs in `cpus` ({} if
    unreadable). Idle and iowait count as free."""
    want = set(cpus)
    out: dict[int, tuple[int, int]] = {}
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            fields = [int(v) for v in rest.split()]
        except ValueError:
            continue
        if cpu in want and len(fields) >= 5:
            total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
            out[cpu] = (total - fields[3] - fields[4], total)
    return out


@dataclass
class CpuSample:
    """Others' use of this process's CPUs over a window: `start()`, work, `busy_cores()`."""

    cpus: list[int]
    ticks: dict[int, tuple[int, int]]
    own_s: float  # this process's user + system seconds at the start
    wall: float

    @classmethod
    def start(cls, cpus: list[int] | None = None) -> "CpuSample":
        cpus = affinity() if cpus is None else cpus
        t = os.times()
        return cls(cpus, cpu_ticks(cpus), t.user + t.system, time.monotonic())

    def busy_cores(self, ticks_per_s: float | None = None) -> float | None:
        """Cores' worth of CPU time that other processes took on our CPUs since start();
        None where the window is too short or /proc/stat unreadable."""
        wall = time.monotonic() - self.wall
        now = cpu_ticks(self.cpus)
        if wall < MIN_WINDOW_S or not self.ticks or set(now) != set(self.ticks):
            return None
        hz = ticks_per_s or os.sysconf("SC_CLK_TCK")
        busy = sum(now[c][0] - self.ticks[c][0] for c in now) / hz
        t = os.times()
        own = (t.user + t.system) - self.own_s
        return max(0.0, busy - own) / wall


def free_threads(busy: float | None, cpus: list[int] | None = None,
                 cores: int | None = None) -> int:
    """The default thread count: the physical cores of `cpus` less `busy` cores' worth of
    other processes' work (rounded to the nearest core), at least 1; all physical cores where
    `busy` is None (not measured)."""
    cpus = affinity() if cpus is None else cpus
    cores = physical_cores(cpus) if cores is None else cores
    if busy is None:
        return cores
    free = len(cpus) - busy
    return max(1, min(cores, int(free + 0.5)))
