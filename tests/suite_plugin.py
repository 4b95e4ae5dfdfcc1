"""Run a test selection across several time-limited calls and summarise it as one run.

A device call lasts at most 10 minutes and the GPU suite takes longer, so the suite runs in
pieces: each call runs what the state file does not hold yet, stops starting tests once its
time budget is spent, and records every outcome in the state file as it goes (a call killed
mid-test loses only that test). The next call, with the same command and the state file
carried back, runs the rest. `--suite-summary` prints the merged result.

    pytest -m gpu --suite-state .gpu-suite/state.json --time-budget 420
    pytest --suite-state .gpu-suite/state.json --suite-summary

Several processes can share one GPU and one call: `--suite-shard I/N` keeps the I-th of N
groups of test modules (whole modules, so a module's fixtures load once, but a very large one
cut into runs of tests; the groups are balanced by the tests' durations in an earlier run's
state file, `--suite-durations FILE`, or by their count without one), each shard writes its
own state file, and `--suite-merge FILE...` folds the shards' files into the main one. Triton compiles on the CPU, so shards cut a cold
call's wall time on a 16-core host.

The state file (JSON) holds:
  selected  the test ids the run calls selected (after -m/-k, before their own deselection)
  tests     id -> {"outcome", "duration", "message", "call"}; outcome is passed, failed, error,
            skipped, xfailed, xpassed, or running (started and never finished: the call was
            killed; it is run again first in the next call, and counts as failed after
            MAX_TRIES unfinished starts)
  collect_errors  id -> message of each module the latest call could not collect
  calls     one record per run call: when it started, how many tests it ran and left, and a
            fingerprint of src/ and tests/ (the summary warns when calls ran different trees)

--suite-summary exits 0 when every selected test ran and none failed, 1 when some failed or
erred, 2 when some are not run yet (call again), 4 when the state file is missing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import pytest

# a test started this many times without finishing (each start killed with its call) is
# recorded as failed rather than retried for ever
MAX_TRIES = 2
DONE = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
BAD = ("failed", "error")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("suite", "a test selection run across several calls")
    group.addoption("--suite-state", metavar="FILE", default=None,
                    help="JSON state of a suite run across calls: the tests it holds are "
                         "deselected, and every outcome of this call is added to it")
    group.addoption("--time-budget", metavar="SECONDS", type=float, default=None,
                    help="with --suite-state: start no test after SECONDS since pytest "
                         "started (but at least one); the rest is left for the next call")
    group.addoption("--suite-later", metavar="MARKER", action="append", default=[],
                    help="with --suite-state: count the selected tests with this marker in "
                         "the suite but leave them for a later call (those that need a model "
                         "this call lacks, say)")
    group.addoption("--suite-shard", metavar="I/N", default=None,
                    help="with --suite-state: run only the I-th (1-based) of N groups of "
                         "test modules, balanced by their tests' durations (--suite-durations) "
                         "or number")
    group.addoption("--suite-durations", metavar="FILE", default=None,
                    help="with --suite-shard: an earlier run's state file, whose recorded "
                         "durations weigh the tests when the shards are balanced (a test it "
                         "lacks weighs the median); a missing file weighs every test alike")
    group.addoption("--suite-merge", metavar="FILE", nargs="+", default=None,
                    help="with --suite-state: fold these shards' state files into it and "
                         "exit")
    group.addoption("--suite-summary", action="store_true", default=False,
                    help="print the merged summary of --suite-state and exit (0: all ran, "
                         "none failed; 1: failures; 2: tests left to run; 4: no state file)")


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    shards = config.getoption("suite_merge")
    if shards:
        if not config.getoption("suite_state"):
            raise pytest.UsageError("--suite-merge needs --suite-state FILE")
        main = Path(config.getoption("suite_state"))
        save_state(main, merge_states(load_state(main), [load_state(Path(f)) for f in shards]))
        return 0
    if not config.getoption("suite_summary"):
        return None
    path = config.getoption("suite_state")
    if not path:
        raise pytest.UsageError("--suite-summary needs --suite-state FILE")
    if not Path(path).is_file():
        print(f"no suite state at {path}: nothing has run yet")
        return 4
    lines, code = summary(load_state(Path(path)), path)
    print("\n".join(lines))
    return code


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("suite_state")
    if path and not config.getoption("suite_summary") and not config.getoption("suite_merge"):
        config.pluginmanager.register(SuiteRun(config, Path(path)), "suite-run")


def load_state(path: Path) -> dict:
    if not path.is_file():
        return {"selected": [], "tests": {}, "calls": [], "collect_errors": {}}
    state = json.loads(path.read_text())
    for key, empty in (("selected", []), ("tests", {}), ("calls", []), ("collect_errors", {})):
        state.setdefault(key, empty)
    return state


def save_state(path: Path, state: dict) -> None:
    """Write through a temporary file, so a call killed mid-write leaves the last state whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, path)


def merge_states(main: dict, shards: list[dict]) -> dict:
    """The main state with the shards' calls folded in: each shard started from a copy of the
    main state, so a test's newest entry (the highest call number) is the one a shard ran."""
    out = {k: (list(v) if isinstance(v, list) else dict(v)) for k, v in main.items()}
    base_calls = len(main["calls"])
    merged_call: dict = {}
    for shard in shards:
        known = set(out["selected"])
        out["selected"] += [t for t in shard["selected"] if t not in known]
        for t, e in shard["tests"].items():
            if t not in out["tests"] or e.get("call", 0) > out["tests"][t].get("call", 0):
                out["tests"][t] = e
        out["collect_errors"].update(shard["collect_errors"])
        for rec in shard["calls"][base_calls:]:
            if not merged_call:
                merged_call = dict(rec, shards=0)
            else:
                merged_call["ran"] += rec["ran"]
                merged_call["left"] += rec["left"]
            merged_call["shards"] += 1
    if merged_call:
        out["calls"].append(merged_call)
    return out


def shard_of(items: list[pytest.Item], index: int, count: int,
             durations: dict[str, float] | None = None) -> set[str]:
    """The node ids of the index-th (1-based) of count groups. The units are whole modules,
    so that a module's fixtures load once, except that a module of more than a 2*count-th of
    the whole is cut into runs of consecutive tests of at most that much (the kernel sweeps:
    a third of the GPU suite's time in one module); the heaviest unit goes first onto the
    lightest group so far. A test weighs its duration in `durations` (seconds; the median of
    those known where it has none), or 1 without durations: the suite's tests run from 0.01 to
    140 s, so groups of equal counts can differ by minutes."""
    durations = durations or {}
    known = sorted(durations[i.nodeid] for i in items if i.nodeid in durations)
    default = known[len(known) // 2] if known else 1.0
    weight = {i.nodeid: durations.get(i.nodeid, default) for i in items}
    # a whole number of median tests, so that equal weights cut as counts do
    limit = max(1, math.ceil(sum(weight.values()) / (2 * count * default))) * default
    modules: dict[str, list[str]] = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item.nodeid)
    units: list[list[str]] = []
    for ids in modules.values():
        run, held = [], 0.0
        for nodeid in ids:
            if run and held + weight[nodeid] > limit:
                units.append(run)
                run, held = [], 0.0
            run.append(nodeid)
            held += weight[nodeid]
        units.append(run)
    groups: list[list[str]] = [[] for _ in range(count)]
    load = [0.0] * count
    for unit in sorted(units, key=lambda u: (-sum(weight[i] for i in u), u[0])):
        g = load.index(min(load))
        groups[g] += unit
        load[g] += sum(weight[i] for i in unit)
    return set(groups[index - 1])


def load_durations(path: str | None) -> dict[str, float]:
    """test id -> seconds from a state file's recorded outcomes; {} without a readable file."""
    if not path or not Path(path).is_file():
        return {}
    tests = load_state(Path(path))["tests"]
    return {t: float(e["duration"]) for t, e in tests.items()
            if is_done(e) and e.get("duration") is not None}


def is_done(entry: dict) -> bool:
    return entry["outcome"] in DONE or entry.get("tries", 0) >= MAX_TRIES


def outcome_of(entry: dict) -> str:
    """An unfinished test started MAX_TRIES times counts as failed."""
    return "failed" if entry["outcome"] == "running" else entry["outcome"]


def summary(state: dict, path: str | Path) -> tuple[list[str], int]:
    """The merged summary's lines and the exit code --suite-summary returns."""
    tests = state["tests"]
    done = {t: e for t, e in tests.items() if is_done(e)}
    left = [t for t in state["selected"] if t not in done]
    counts: dict[str, int] = {}
    for e in done.values():
        counts[outcome_of(e)] = counts.get(outcome_of(e), 0) + 1
    calls = state["calls"]
    ran_s = sum(e.get("duration", 0.0) for e in done.values())
    lines = [f"suite state {path}: {len(calls)} call(s), {ran_s:.0f} s of tests"]
    parts = [f"{counts[k]} {k}" for k in DONE if counts.get(k)]
    parts.append(f"{len(left)} not yet run")
    if state["collect_errors"]:
        parts.append(f"{len(state['collect_errors'])} module(s) not collected")
    lines.append(", ".join(parts))
    for t in sorted(done):
        e = done[t]
        if outcome_of(e) in BAD:
            why = e.get("message") or ("did not finish within a call" if e["outcome"] == "running"
                                       else "")
            lines.append(f"{outcome_of(e).upper()} {t}" + (f" - {why}" if why else ""))
    for t, why in sorted(state["collect_errors"].items()):
        lines.append(f"ERROR collecting {t}" + (f" - {why}" if why else ""))
    for t in left[:20]:
        lines.append(f"NOT RUN {t}")
    if len(left) > 20:
        lines.append(f"NOT RUN ... and {len(left) - 20} more")
    prints = {c.get("fingerprint") for c in calls if c.get("fingerprint")}
    if len(prints) > 1:
        lines.append(f"warning: the calls ran {len(prints)} different trees (src/ and tests/ "
                     "changed between calls); start again from an empty state for one result")
    bad = any(outcome_of(e) in BAD for e in done.values()) or bool(state["collect_errors"])
    if left:
        lines.append("tests are left: run the same command again")
        return lines, 2
    lines.append("the suite has run whole" + (" with failures" if bad else ", green"))
    return lines, 1 if bad else 0


def tree_fingerprint(root: Path) -> str:
    """A digest of the sources and tests, to tell whether the calls ran one tree."""
    digest = hashlib.sha1()
    for top in ("src", "tests"):
        base = root / top
        if not base.is_dir():
            continue
        for f in sorted(base.rglob("*")):
            if f.suffix in (".py", ".c", ".h") and "__pycache__" not in f.parts:
                digest.update(str(f.relative_to(root)).encode())
                digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


class SuiteRun:
    """The plugin of one run call: deselects what the state holds, keeps to the time budget,
    and records outcomes as they come."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.start = time.monotonic()
        self.budget = config.getoption("time_budget")
        self.shard = _shard(config.getoption("suite_shard"))
        self.state = load_state(path)
        self.state["collect_errors"] = {}  # the latest call's
        self.call = len(self.state["calls"]) + 1
        self.record = {"call": self.call, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "fingerprint": tree_fingerprint(config.rootpath), "ran": 0, "left": 0}
        self.state["calls"].append(self.record)
        self.reports: dict[str, list[pytest.TestReport]] = {}
        self.stopped = False
        self.started = 0

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        tests = self.state["tests"]
        # the union over calls, so that a test one call selects stays in the suite
        known = set(self.state["selected"])
        self.state["selected"] += [item.nodeid for item in items if item.nodeid not in known]
        later = self.config.getoption("suite_later")
        keep = [item for item in items
                if (item.nodeid not in tests or not is_done(tests[item.nodeid]))
                and not any(item.get_closest_marker(m) for m in later)]
        if self.shard:
            index, count = self.shard
            # grouped over what is left, so that the shards of a later call share its rest
            durations = load_durations(config.getoption("suite_durations"))
            mine = shard_of(keep, index, count, durations)
            keep = [item for item in keep if item.nodeid in mine]
        gone = [item for item in items if item not in keep]
        # a test a killed call left unfinished runs first, with the whole budget before it
        keep.sort(key=lambda item: item.nodeid not in tests)
        if gone:
            config.hook.pytest_deselected(items=gone)
        items[:] = keep
        self.record["left"] = len(keep)
        save_state(self.path, self.state)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        spent = time.monotonic() - self.start
        over = self.budget is not None and spent >= self.budget
        # every call starts at least one test, so that a slow start cannot stall the suite
        if self.stopped or (over and self.started):
            self.stopped = True
            return True  # not run and not reported: left in the state for the next call
        self.started += 1
        entry = self.state["tests"].get(item.nodeid, {})
        self.state["tests"][item.nodeid] = {"outcome": "running", "call": self.call,
                                            "tries": entry.get("tries", 0) + 1}
        save_state(self.path, self.state)
        return None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # a module that cannot be imported here hides its tests: the summary names it
        if report.failed:
            self.state["collect_errors"][report.nodeid] = _first_line(report)
            save_state(self.path, self.state)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.reports.setdefault(report.nodeid, []).append(report)
        if report.when != "teardown":
            return
        reports = self.reports.pop(report.nodeid)
        entry = {"outcome": _outcome(reports), "call": self.call,
                 "duration": round(sum(r.duration for r in reports), 3)}
        failed = [r for r in reports if r.failed]
        if failed:
            entry["message"] = _first_line(failed[0])
        self.state["tests"][report.nodeid] = entry
        self.record["ran"] += 1
        self.record["left"] -= 1
        save_state(self.path, self.state)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        left = self.record["left"]
        spent = time.monotonic() - self.start
        terminalreporter.write_sep("-", "suite across calls")
        terminalreporter.write_line(
            f"this call ran {self.record['ran']} test(s) in {spent:.0f} s; {left} left for the "
            f"next call" + (" (the time budget is spent)" if self.stopped else ""))
        lines, _ = summary(self.state, self.path)
        terminalreporter.write_line(lines[1])


def _shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--suite-shard {text}: I must lie in 1..N, as in 2/3")
    return index, count


def _outcome(reports: list[pytest.TestReport]) -> str:
    for r in reports:
        if r.failed:
            return "failed" if r.when == "call" else "error"
    for r in reports:
        if hasattr(r, "wasxfail"):
            return "xfailed" if r.skipped else "xpassed"
        if r.skipped:
            return "skipped"
    return "passed"


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:200] if text.strip() else ""
