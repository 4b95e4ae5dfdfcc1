"""The suite plugin (tests/suite_plugin.py) on a generated test file: a marked selection split
across calls by the time budget, the state file carried between them, and one merged summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from suite_plugin import load_state, summary as merged

TESTS = """
import pytest
from pathlib import Path

def _ran(name):
    with open(Path(__file__).parent / "ran.txt", "a") as f:
        f.write(name + "\\n")

@pytest.mark.dev
def test_a():
    _ran("a")

@pytest.mark.dev
def test_b():
    _ran("b")
    assert 1 == 2, "b is wrong"

@pytest.mark.dev
def test_c():
    _ran("c")
    pytest.skip("no device")

@pytest.mark.dev
@pytest.mark.parametrize("n", [1, 2])
def test_d(n):
    _ran(f"d{n}")

def test_unmarked():
    _ran("unmarked")
"""

INI = """
[pytest]
markers =
    dev: a stand-in for the gpu marker
"""


@pytest.fixture
def suite(pytester: pytest.Pytester):
    pytester.makeini(INI)
    pytester.makepyfile(test_fake=TESTS)
    return pytester


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # hypothesis's plugin takes about 1 s to configure, and the runs here need none
    return pytester.runpytest("-p", "suite_plugin", "-p", "no:cacheprovider",
                              "-p", "no:hypothesispytest", *args)


def _summary(state) -> tuple[str, int]:
    """--suite-summary's text and exit code (the option itself runs in test_summary_option)."""
    lines, code = merged(load_state(state), state)
    return "\n".join(lines), code


def _ran(pytester: pytest.Pytester) -> list[str]:
    path = pytester.path / "ran.txt"
    return path.read_text().split() if path.exists() else []


def test_budget_splits_the_selection_across_calls_and_the_summary_merges_them(suite):
    state = suite.path / ".gpu-suite" / "state.json"
    calls = 0
    while True:
        # a budget of 0 s is spent before the first test: each call runs exactly one
        _run(suite, "-m", "dev", f"--suite-state={state}", "--time-budget=0")
        calls += 1
        text, code = _summary(state)
        if code != 2:
            break
        assert "tests are left: run the same command again" in text
        assert calls < 10
    assert calls == 5
    ran = _ran(suite)
    assert sorted(ran) == ["a", "b", "c", "d1", "d2"]  # each once, and never the unmarked one
    assert code == 1
    pytest.LineMatcher(text.splitlines()).fnmatch_lines([
        "suite state *: 5 call(s), * s of tests",
        "3 passed, 1 failed, 1 skipped, 0 not yet run",
        "FAILED test_fake.py::test_b - AssertionError: b is wrong*",
        "the suite has run whole with failures",
    ])
    data = json.loads(state.read_text())
    assert sorted(data["selected"]) == sorted(
        f"test_fake.py::{t}" for t in ("test_a", "test_b", "test_c", "test_d[1]", "test_d[2]"))
    # once whole, a further call runs nothing
    _run(suite, "-m", "dev", f"--suite-state={state}", "--time-budget=0")
    assert len(_ran(suite)) == 5


def test_a_budget_left_over_runs_the_rest_in_one_call(suite):
    state = suite.path / "state.json"
    result = _run(suite, "-m", "dev", f"--suite-state={state}", "--time-budget=600")
    result.assert_outcomes(passed=3, failed=1, skipped=1, deselected=1)
    result.stdout.fnmatch_lines(["*this call ran 5 test(s) in * s; 0 left for the next call*"])
    assert _summary(state)[1] == 1


def test_tests_left_for_later_count_as_not_yet_run(suite):
    state = suite.path / "state.json"
    _run(suite, "-m", "dev", f"--suite-state={state}", "--suite-later=parametrize")
    assert sorted(_ran(suite)) == ["a", "b", "c"]
    text, code = _summary(state)
    assert "1 passed, 1 failed, 1 skipped, 2 not yet run" in text and code == 2
    _run(suite, "-m", "dev", f"--suite-state={state}")
    assert sorted(_ran(suite)) == ["a", "b", "c", "d1", "d2"]
    assert _summary(state)[1] == 1


def test_summary_option(suite, monkeypatch):
    # the option returns before pytest collects: a subprocess, where the in-process runner
    # expects a run's records
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get(
        "PYTHONPATH")])))
    state = suite.path / "state.json"
    assert suite.runpytest_subprocess(f"--suite-state={state}", "--suite-summary",
                                      "-p", "suite_plugin", "-p", "no:hypothesispytest").ret == 4
    _run(suite, "-m", "dev", f"--suite-state={state}", "--time-budget=600", "-k", "not test_b")
    result = suite.runpytest_subprocess(f"--suite-state={state}", "--suite-summary",
                                        "-p", "suite_plugin", "-p", "no:hypothesispytest")
    result.stdout.fnmatch_lines(["3 passed, 1 skipped, 0 not yet run",
                                 "the suite has run whole, green"])
    assert result.ret == 0


def test_a_test_its_call_was_killed_in_runs_first_then_counts_as_failed(suite):
    state = suite.path / "state.json"
    # as a killed call leaves it: test_d[2] started and never finished, the rest not run
    state.write_text(json.dumps({"selected": [], "calls": [{"call": 1}], "tests": {
        "test_fake.py::test_d[2]": {"outcome": "running", "call": 1, "tries": 1}}}))
    _run(suite, "-m", "dev", f"--suite-state={state}", "--time-budget=0")
    assert _ran(suite) == ["d2"]
    # started twice without finishing: failed, and not tried a third time
    tests = json.loads(state.read_text())["tests"]
    tests["test_fake.py::test_a"] = {"outcome": "running", "call": 2, "tries": 2}
    state.write_text(json.dumps({"selected": [], "calls": [], "tests": tests}))
    _run(suite, "-m", "dev", f"--suite-state={state}", "--time-budget=600")
    assert sorted(_ran(suite)) == ["b", "c", "d1", "d2"]
    text, code = _summary(state)
    assert "FAILED test_fake.py::test_a - did not finish within a call" in text.splitlines()
    assert code == 1


def test_shards_split_whole_modules_and_merge_into_one_state(suite):
    """Two shards run side by side from copies of the main state, each whole modules only;
    the merge gives the same summary as one process would, as one call."""
    suite.makepyfile(test_other=TESTS.replace("_ran(\"", "_ran(\"o").replace("_ran(f\"", "_ran(f\"o"))
    main = suite.path / "state.json"
    shards = [suite.path / f"shard-{i}.json" for i in (1, 2)]
    for i, shard in enumerate(shards, 1):
        _run(suite, "-m", "dev", f"--suite-state={shard}", f"--suite-shard={i}/2")
    ran = _ran(suite)
    assert sorted(ran) == sorted(["a", "b", "c", "d1", "d2", "oa", "ob", "oc", "od1", "od2"])
    for shard in shards:  # each shard ran one whole module (5 tests: none is cut)
        tests = load_state(shard)["tests"]
        assert len({t.split("::")[0] for t in tests}) == 1 and len(tests) == 5
    result = _run(suite, f"--suite-state={main}", "--suite-merge", *map(str, shards))
    assert result.ret == 0
    text, code = _summary(main)
    assert code == 1
    assert "6 passed, 2 failed, 2 skipped, 0 not yet run" in text
    assert "1 call(s)" in text and len(load_state(main)["calls"][0]) and \
        load_state(main)["calls"][0]["shards"] == 2
    # a later call's shards start from the merged state and find nothing left
    for i, shard in enumerate(shards, 1):
        shard.write_text(main.read_text())
        _run(suite, "-m", "dev", f"--suite-state={shard}", f"--suite-shard={i}/2")
    assert len(_ran(suite)) == 10


def test_a_shard_outside_its_count_is_refused(suite):
    result = _run(suite, "-m", "dev", f"--suite-state={suite.path / 's.json'}",
                  "--suite-shard=3/2")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--suite-shard 3/2: I must lie in 1..N*"])


def test_a_module_of_most_of_the_tests_is_cut_between_shards(suite):
    """One module of 5 tests beside none: with 2 shards a unit holds at most 2 tests (a
    2*N-th of the whole), so both shards get some of it and together run it once."""
    states = [suite.path / f"s{i}.json" for i in (1, 2)]
    for i, state in enumerate(states, 1):
        _run(suite, "-m", "dev", f"--suite-state={state}", f"--suite-shard={i}/2")
    counts = [len(load_state(s)["tests"]) for s in states]
    assert sorted(_ran(suite)) == ["a", "b", "c", "d1", "d2"] and sorted(counts) == [2, 3]


def test_shards_balance_the_durations_of_an_earlier_run(suite):
    """With an earlier run's durations, one slow test outweighs four quick ones: 2 shards put
    it alone in one group and the rest in the other (by count they would split 3 and 2); a
    missing durations file falls back to counts."""
    earlier = suite.path / "earlier.json"
    _run(suite, "-m", "dev", f"--suite-state={earlier}")
    state = load_state(earlier)
    for t, e in state["tests"].items():
        e["duration"] = 60.0 if t.endswith("test_d[2]") else 0.5
    earlier.write_text(json.dumps(state))
    for durations, want in ((earlier, [[4], [1]]), (suite.path / "none.json", [[2], [3]])):
        groups = []
        for i in (1, 2):
            s = suite.path / f"w{i}.json"
            s.unlink(missing_ok=True)
            _run(suite, "-m", "dev", f"--suite-state={s}", f"--suite-shard={i}/2",
                 f"--suite-durations={durations}")
            groups.append(sorted(load_state(s)["tests"]))
        assert sorted([len(g)] for g in groups) == sorted(want), groups
        if durations == earlier:
            assert ["test_fake.py::test_d[2]"] in groups
