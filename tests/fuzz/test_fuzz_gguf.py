"""The GGUF mutation fuzzer (tests/fuzz/fuzz_gguf.py) in CI: a fixed seed and a few thousand mutated
synth files plus a few dozen mutations of the default model, each of which must end in a
SlipstreamError or load and generate finite logits; no uncaught exception, crash, hang, memory
blow-up or NaN. The CLI on a sample of them: one line on stderr, never a traceback. Plus the
harness itself: its documents round-trip, its cases can be rebuilt, and it classifies faults it
is handed. Loud mutations (an absurd block scale, norm or bias; a near rename) must be refused
or load with a warning naming the damaged tensor: a sample in the fast tier, more in the slow
one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_gguf  # noqa: E402

CI_SEED = 20261130
# ~50 cases/s a worker on a 2-core machine: about a minute of CPU
CI_CASES = int(os.environ.get("SLIPSTREAM_FUZZ_CASES", "3000"))
SMOLLM_CASES = 24  # ~1.4 s each: the 98 MB file is rebuilt and parsed for every case


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-seeds")


@pytest.fixture(scope="module")
def seeds(seed_dir):
    return fuzz_gguf._seed_objs(fuzz_gguf.make_seeds(seed_dir))


def test_seed_documents_round_trip(seeds):
    for s in seeds:
        assert fuzz_gguf.serialize(s.doc) == s.data, s.name


def test_seed_files_load_and_generate(seeds):
    for s in seeds:
        res = fuzz_gguf.check_file(s.path, full=True)
        assert res["outcome"] == "ok", (s.name, res)


def test_cases_are_reproducible(seeds):
    for case in range(0, 400, 7):
        a = fuzz_gguf.make_case(seeds, CI_SEED, case)
        b = fuzz_gguf.make_case(seeds, CI_SEED, case)
        assert a[0].name == b[0].name and a[1] == b[1] and a[3] == b[3]


@pytest.mark.slow
def test_fuzz_ci(seed_dir):
    t0 = time.time()
    report = fuzz_gguf.fuzz(CI_CASES, seed=CI_SEED, jobs=2, full_fraction=0.05,
                            timeout=60.0, workdir=seed_dir)
    counts = report["counts"]
    print(f"\nfuzz: {report['cases']} cases in {time.time() - t0:.0f}s: {counts}; "
          f"clean errors: {report['clean_error_classes']}")
    assert report["cases"] == CI_CASES and report["harness_errors"] == 0, report["bad_cases"][:5]
    bad = [{k: b.get(k) for k in ("case", "outcome", "seed_file", "desc", "error", "message")}
           for b in report["bad_cases"]]
    assert report["bad_total"] == 0, json.dumps(bad[:10], indent=1) + (
        f"\nrebuild one with: python tests/fuzz/fuzz_gguf.py --seed {CI_SEED} --repro CASE")
    # the mix stays useful: most files refused, and a good share loaded
    assert counts["clean"] > CI_CASES // 2
    assert counts["ok"] > CI_CASES // 20


@pytest.mark.slow
def test_harness_classifies_faults(seed_dir, monkeypatch):
    monkeypatch.setenv("FUZZ_GGUF_INJECT", "1:hang,2:crash,3:rss,4:uncaught")
    report = fuzz_gguf.fuzz(6, seed=CI_SEED, jobs=1, timeout=10.0, mem_growth_mib=256,
                            workdir=seed_dir)
    by_case = {b["case"]: b["outcome"] for b in report["bad_cases"]}
    assert by_case == {1: "hang", 2: "crash", 3: "memory", 4: "uncaught"}
    assert report["cases"] == 6 and report["bad_total"] == 4


@pytest.mark.slow
def test_fuzz_default_model(smollm_path, seed_dir):
    # the real file: a 49k-token vocabulary, 30 layers, Q4_1 and Q8_0 tensors
    report = fuzz_gguf.fuzz(SMOLLM_CASES, seed=CI_SEED, jobs=1, full_fraction=0.05,
                            smollm=smollm_path, only="smollm2", timeout=120.0,
                            workdir=seed_dir)
    counts = report["counts"]
    print(f"\nfuzz (default model): {report['cases']} cases in {report['elapsed_s']}s: {counts}")
    assert report["cases"] == SMOLLM_CASES and report["harness_errors"] == 0
    assert report["bad_total"] == 0, json.dumps(report["bad_cases"][:5], indent=1)
    assert report["by_seed_file"].keys() == {"smollm2"}
    assert counts["clean"] > 0


def _loud_cases(seeds, per_class: int, by_seed: bool = True,
                search: int = 4000) -> list[tuple[int, list[str]]]:
    """The first `per_class` cases of each loud mutation class (of each seed file, with
    `by_seed`) under the CI seed: (case, the tensor names it damaged)."""
    keys = len(fuzz_gguf.LOUD) * (len(seeds) if by_seed else 1)
    picked: dict[tuple[str, str], list[tuple[int, list[str]]]] = {}
    for case in range(search):
        s, _, cls, desc = fuzz_gguf.make_case(seeds, CI_SEED, case)
        names = fuzz_gguf.loud_names(cls, desc)
        key = (cls, s.name if by_seed else "")
        if names is not None and len(picked.setdefault(key, [])) < per_class:
            picked[key].append((case, names))
            if len(picked) == keys and all(len(v) == per_class for v in picked.values()):
                break
    return sorted(c for cases in picked.values() for c in cases)


def _check_loud(seeds, cases, tmp_path) -> dict[str, int]:
    """Each case's file refused by a SlipstreamError or loaded with a warning naming what
    was damaged (check_file's 'silent' otherwise); the outcomes counted."""
    outcomes: dict[str, int] = {}
    path = tmp_path / "case.gguf"
    for case, names in cases:
        s, data, cls, desc = fuzz_gguf.make_case(seeds, CI_SEED, case)
        path.write_bytes(data)
        res = fuzz_gguf.check_file(path, full=True, expect=names)
        where = (case, s.name, desc, res)
        loaded = res.get("stage") == "generate" or res["outcome"] in ("ok", "nan")
        if loaded:  # then a warning named it (it may still fail later: NonFiniteLogits)
            assert any(n in w for w in res.get("warnings", []) for n in names), where
            key = f"{cls}:warned"
        else:  # refused: the error names the tensor, or says which one is missing
            assert res["outcome"] == "clean", where
            assert any(n in res["message"] for n in names) or "missing" in res["message"], where
            key = f"{cls}:{res['error']}"
        outcomes[key] = outcomes.get(key, 0) + 1
    return outcomes


def test_loud_mutations_never_load_silently(seeds, tmp_path):
    """One case of each loud mutation class (absurd scale, norm or bias; a near rename) on
    the micro seeds, in process: refused, naming the tensor."""
    micro = [s for s in seeds if s.name.startswith("micro")]
    cases = _loud_cases(micro, per_class=1, by_seed=False)
    assert {fuzz_gguf.make_case(micro, CI_SEED, c)[2] for c, _ in cases} == set(fuzz_gguf.LOUD)
    refused = _check_loud(micro, cases, tmp_path)
    assert not any(k.endswith(":warned") for k in refused), refused


@pytest.mark.slow
def test_loud_mutations_many(seeds, tmp_path, monkeypatch):
    """6 cases of each loud class on each seed file, in process, checked on (~0.1 s a case),
    then off (SLIPSTREAM_CHECK_WEIGHTS=0: loaded with a warning naming the tensor, unless
    a tensor the model needs is gone)."""
    cases = _loud_cases(seeds, per_class=6)
    assert len(cases) == 6 * len(fuzz_gguf.LOUD) * len(seeds)
    refused = _check_loud(seeds, cases, tmp_path)
    assert not any(k.endswith(":warned") for k in refused), refused
    monkeypatch.setenv("SLIPSTREAM_CHECK_WEIGHTS", "0")
    warned = _check_loud(seeds, cases, tmp_path)
    print(f"\n{len(cases)} loud cases: checked {refused}; SLIPSTREAM_CHECK_WEIGHTS=0 {warned}")
    assert sum(v for k, v in warned.items() if k.endswith(":warned")) > len(cases) // 2


def _cli_sample(seeds, per_class: int = 1) -> list[tuple[int, str]]:
    """The first case of each mutation class under the CI seed: (case, class)."""
    picked: dict[str, int] = {}
    for case in range(2000):
        cls = fuzz_gguf.make_case(seeds, CI_SEED, case)[2].split("+")[0]
        picked.setdefault(cls, case)
    return sorted((c, k) for k, c in picked.items())


@pytest.mark.slow
def test_cli_never_prints_a_traceback(seeds, tmp_path):
    """`slipstream run` on one mutated file of each mutation class: it either runs (exit 0) or
    prints exactly one `error:` line and exits 1; no traceback either way."""
    sample = _cli_sample(seeds)
    assert len(sample) >= 10, sample
    refused = 0
    env = dict(os.environ, PYTHONPATH=str(Path(fuzz_gguf.SRC)), OMP_NUM_THREADS="1")
    for case, cls in sample:
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(fuzz_gguf.make_case(seeds, CI_SEED, case)[1])
        r = subprocess.run([sys.executable, "-m", "slipstream", "run", "-m", str(path), "-p",
                            "hi", "-n", "1", "--device", "cpu", "--ctx", "64"],
                           capture_output=True, text=True, timeout=300, env=env)
        where = f"case {case} ({cls}): rc {r.returncode}, stderr {r.stderr[-2000:]!r}"
        assert "Traceback" not in r.stderr + r.stdout, where
        if r.returncode != 0:
            # one error line, after any warning lines of the load (unused tensors)
            lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("warning:")]
            assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:"), where
            refused += 1
    assert 0 < refused < len(sample), f"{refused} of {len(sample)} refused: not a useful sample"
