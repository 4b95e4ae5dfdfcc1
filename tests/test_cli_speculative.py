"""Speculative decoding and `quantize` through the CLI, in subprocesses, on the real default
model with a draft made by `slipstream quantize` (its Q4_1 matrices re-encoded as Q4_0: the same
vocabulary, weights a second rounding away, so the draft often guesses right)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

import slipstream
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import SHAPES, write_synth


# "exact": with "fast" CPU weights a tree pass and a decode step round differently, enough to
# flip a near-tie between the top two tokens (tests/speculative/test_speculative.py)
# --raw: 24 tokens of completion whatever the text (a chat reply may end sooner)
RUN = ("--device", "cpu", "--ctx", "256", "--precision", "exact", "--temp", "0", "-n", "24",
       "--raw")
PROSE = ("The quick brown fox jumps over the lazy dog. The capital of France is Paris, and "
         "the capital of Italy is Rome.")
SPEC_ROWS = ("tokens per target pass", "target passes", "mean tree nodes",
             "accepted drafted tokens: passes", "draft ms / pass", "verify ms / pass")


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # wide: rich wraps a table's cells at the terminal's width (80 when there is none)
    return subprocess.run([sys.executable, "-m", "slipstream.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def quantized(smollm_path, tmp_path_factory):
    """`quantize SRC DST Q4_0 --only Q4_1` once: the draft of every test here."""
    dst = tmp_path_factory.mktemp("cli-spec") / "draft-q4_0.gguf"
    r = cli("quantize", str(smollm_path), str(dst), "Q4_0", "--only", "Q4_1")
    return dst, r


@pytest.fixture(scope="module")
def draft(quantized) -> Path:
    path, r = quantized
    assert r.returncode == 0, r.stderr
    return path


def _row(stderr: str, name: str) -> str:
    """A value of the speculative stats table (rich draws it with box characters)."""
    m = re.search(re.escape(name) + r"\s*│\s*([^│]+?)\s*│", stderr)
    assert m, f"no {name!r} row in:\n{stderr}"
    return m.group(1)


@pytest.mark.slow
def test_quantize_round_trip(smollm_path, quantized):
    path, r = quantized
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{path}\n"  # the output path, for scripts
    assert "Traceback" not in r.stderr
    src, out = GGUFFile(smollm_path), GGUFFile(path)
    try:
        assert set(out.tensors) == set(src.tensors)
        for name, info in src.tensors.items():
            want = Q.Q4_0 if info.ggml_type == Q.Q4_1 else info.ggml_type
            assert out.tensors[name].ggml_type == want, name
        assert sum(t.ggml_type == Q.Q4_0 for t in out.tensors.values()) > 100
        assert out.metadata["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
    finally:
        src.close()
        out.close()
    # it loads, and predicts much as its source does (a second rounding of 135M parameters
    # moves the top token on about a third of this text; broken weights would on nearly all)
    with slipstream.load(smollm_path, device="cpu", ctx=64) as a, \
            slipstream.load(path, device="cpu", ctx=64) as b:
        ids = a.tokenize(PROSE)
        la, lb = a.logits(ids), b.logits(ids)
    agree = float((la.argmax(-1) == lb.argmax(-1)).float().mean())
    assert 0.4 < agree and not la.equal(lb), agree


def test_quantize_bad_type_is_one_line(smollm_path, tmp_path):
    dst = tmp_path / "out.gguf"
    r = cli("quantize", str(smollm_path), str(dst), "Q9_9")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "cannot quantize to 'Q9_9'" in r.stderr and "Q4_0" in r.stderr
    assert not dst.exists() and r.stdout == ""


@pytest.fixture(scope="module")
def plain_run(smollm_path) -> subprocess.CompletedProcess:
    r = cli("run", "-m", str(smollm_path), *RUN, "--stats")
    assert r.returncode == 0, r.stderr
    assert "speculative decoding" not in r.stderr  # no draft, no table
    return r


def _spec_figures(stderr: str) -> tuple[int, float, list[int]]:
    """(target passes, tokens per pass, accepted histogram) of the table, checked against
    each other: RUN's 23 tokens after the prefill's all came from target passes."""
    for name in SPEC_ROWS:
        _row(stderr, name)
    passes = int(_row(stderr, "target passes"))
    per_pass = float(_row(stderr, "tokens per target pass"))
    assert abs(per_pass * passes - 23) <= 0.005 * passes + 1e-9, (per_pass, passes)
    pairs = [pair.split(": ") for pair in _row(stderr, SPEC_ROWS[3]).split("  ")]
    assert [int(a) for a, _ in pairs] == list(range(len(pairs)))
    hist = [int(n) for _, n in pairs]
    assert sum(hist) == passes
    assert float(_row(stderr, "verify ms / pass")) > 0
    return passes, per_pass, hist


@pytest.mark.slow
def test_run_with_a_draft_prints_what_plain_run_prints(smollm_path, draft, plain_run):
    """Trees sized automatically (from costs measured as it runs: on a CPU, with a draft as
    big as the model, mostly plain steps); the text is the plain run's whatever they are."""
    r = cli("run", "-m", str(smollm_path), *RUN, "--draft", str(draft), "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain_run.stdout and len(r.stdout) > 24
    _spec_figures(r.stderr)


@pytest.mark.slow
def test_run_with_the_lowbit_self_draft(smollm_path, plain_run):
    """--draft-lowbit: no second file; the text is the plain run's, and the plan table names
    the copy."""
    r = cli("run", "-m", str(smollm_path), *RUN, "--draft-lowbit", "Q2_K", "--spec-nodes",
            "16", "--spec-depth", "6", "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain_run.stdout
    assert "self: Q2_K copy, 30 layers" in r.stderr
    passes, per_pass, _ = _spec_figures(r.stderr)
    assert per_pass > 1.5, (passes, per_pass)


@pytest.mark.slow
def test_run_spec_nodes_and_depth_fix_the_trees(smollm_path, draft, plain_run):
    r = cli("run", "-m", str(smollm_path), *RUN, "--draft", str(draft), "--spec-nodes", "16",
            "--spec-depth", "4", "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain_run.stdout
    passes, per_pass, hist = _spec_figures(r.stderr)
    assert len(hist) <= 5  # at most 4 drafted tokens accepted per pass
    nodes = float(_row(r.stderr, "mean tree nodes"))
    assert 4 < nodes <= 16  # every pass but a last short one verified a tree
    assert float(_row(r.stderr, "draft ms / pass")) > 0
    # the requantized draft is mostly right: passes yield several tokens each
    assert per_pass > 1.5, hist


@pytest.mark.slow
def test_chat_with_a_draft(smollm_path, draft):
    messages = [{"role": "user", "content": "Name three colors."}]
    with slipstream.load(smollm_path, device="cpu", ctx=256, precision="exact") as model:
        want = "".join(e.text for e in model.chat(messages, max_tokens=12, temperature=0))
    r = cli("chat", "-m", str(smollm_path), "--device", "cpu", "--ctx", "256", "--precision",
            "exact", "--temp", "0", "-n", "12", "--draft", str(draft), "--spec-nodes", "8",
            "--spec-depth", "2", "-v", stdin="Name three colors.\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert float(_row(r.stderr, "tokens per target pass")) > 1


@pytest.mark.slow
def test_bench_with_a_draft(smollm_path, draft, tmp_path):
    out = tmp_path / "bench.json"
    r = cli("bench", "-m", str(smollm_path), "--pp", "16", "--tg", "8", "--reps", "1",
            "--device", "cpu", "--precision", "exact", "--draft", str(draft), "--spec-nodes",
            "8", "--spec-depth", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["draft"] == str(draft) and (doc["spec_nodes"], doc["spec_depth"]) == (8, 3)
    pp, tg = doc["results"]
    assert pp["test"] == "pp16" and "tokens_per_pass" not in pp
    assert tg["test"] == "tg8" and tg["tok_s"] > 0
    # 8 tokens after the prefill's: the passes yielded them all
    assert tg["tokens_per_pass"] * tg["target_passes"] == pytest.approx(8)
    assert tg["tokens_per_pass"] > 1 and tg["draft_s"] > 0 and tg["verify_s"] > 0
    assert "tok / pass" in r.stdout and "verify s" in r.stdout


@pytest.mark.parametrize("flags, message", [
    (["--draft", "D", "--spec-nodes", "0"], "--spec-nodes 0 is invalid: must be >= 1"),
    (["--draft", "D", "--spec-depth", "-1"], "--spec-depth -1 is invalid: must be >= 1"),
    (["--draft", "D", "--draft-skip-layers", "2"], "--draft and --draft-skip-layers are 2"),
    (["--spec-nodes", "8"], "give --draft PATH, --draft-skip-layers K or --draft-lowbit TYPE"),
    (["--draft-lowbit", "Q2_K", "--draft-skip-layers", "2"],
     "--draft-skip-layers and --draft-lowbit are 2 kinds of draft"),
    (["--draft-lowbit", "Q7_Z"], "cannot make a low-bit copy in 'Q7_Z'"),
])
@pytest.mark.parametrize("command", ["run", "bench", "serve"])
def test_draft_flag_errors_come_before_loading(tmp_path, command, flags, message):
    # a model that does not exist: an error that waited for the load would name it instead
    r = cli(command, "-m", str(tmp_path / "missing.gguf"), "--device", "cpu", *flags)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_a_draft_of_another_vocabulary_is_one_line(smollm_path, tmp_path):
    """As many tokens as the model, other ones: refused before either model loads."""
    other = write_synth(tmp_path / "other-vocab.gguf", replace(SHAPES["tiny"], vocab=49152),
                        "Q8_0", n_layers=1)
    r = cli("run", "-m", str(smollm_path), "--device", "cpu", "-n", "2", "--draft", str(other))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "does not share the vocabulary" in r.stderr and "other-vocab.gguf" in r.stderr
    assert r.stdout == ""
