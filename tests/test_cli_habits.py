"""What llama.cpp and ollama users type out of habit: `-c N`, `run MODEL "prompt"`, `-n 0`,
`quantize` of a cached name, chat-by-default on an Instruct model, and the warnings for a
context past the model's training and for GPU flags on a CPU. Parsing and warnings run in
process on synthetic models (fast); generation runs `slipstream` itself."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.cli import build_parser, main, parse_args
from slipstream.cli.notices import ctx_warning, gpu_flags_warning
from slipstream.cli.rules import check_args
from slipstream.errors import BadArgument, ModelNotFound
from slipstream.model.layer_spec import kv_cache_bytes
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 2-layer random Llama (trained context 2048, no chat template), in its own folder."""
    return write_synth(tmp_path_factory.mktemp("habits") / "tiny-habits.gguf", "tiny", "Q8_0")


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny) -> Path:
    """A cache holding `tiny` under its file name, so that its stem is a cached model's name."""
    root = tmp_path / "cache"
    root.mkdir()
    (root / tiny.name).symlink_to(tiny)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(root))
    return root


def parsed(*argv: str) -> argparse.Namespace:
    a = parse_args(build_parser(), list(argv))
    check_args(a)
    return a


# --- -c and the positionals ------------------------------------------------------------------


@pytest.mark.parametrize("command", [["run"], ["chat"], ["bench"], ["info"],
                                     ["perplexity", "-f", "text.txt"]])
def test_c_is_ctx(command):
    a = parse_args(build_parser(), [*command, "-c", "2048"])
    assert a.ctx == 2048


def test_run_model_and_prompt_positionals(tiny):
    a = parsed("run", str(tiny), "Tell me a story")
    assert (a.model, a.prompt) == (str(tiny), "Tell me a story")
    # after an option, as `llama-cli`'s users mix them
    a = parsed("run", str(tiny), "-n", "8", "Tell me a story")
    assert (a.model, a.prompt, a.max_tokens) == (str(tiny), "Tell me a story", 8)


def test_a_lone_positional_that_names_no_model_is_the_prompt(cache):
    a = parsed("run", "hello there")
    assert (a.model, a.prompt) == (None, "hello there")  # None: the default model


def test_a_lone_positional_that_names_a_model_is_the_model(tiny, cache):
    for word in (str(tiny), "tiny-habits", "tiny-habits.gguf"):  # a path, cached names
        a = parsed("run", word)
        assert Path(a.model).resolve() == tiny.resolve(), word
        assert a.prompt == "Once upon a time,"  # the default prompt


def test_a_missing_gguf_positional_is_a_missing_model(tmp_path, cache):
    with pytest.raises(ModelNotFound, match="missing.gguf"):
        parsed("run", str(tmp_path / "missing.gguf"), "hi")
    with pytest.raises(ModelNotFound, match="elsewhere.gguf"):
        parsed("run", "elsewhere.gguf")  # not sent to the default model as a prompt


def test_model_or_prompt_given_twice_is_refused(tiny):
    with pytest.raises(BadArgument, match="the model is given twice"):
        parsed("run", "-m", str(tiny), str(tiny), "hi")
    with pytest.raises(BadArgument, match=r"the prompt is given twice: -p and 'hi'"):
        parsed("run", "-p", "hello", "hi")


def test_a_third_positional_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "a.gguf", "prompt", "stray"])
    assert e.value.code == 1
    assert "unrecognized arguments: stray" in capsys.readouterr().err


# --- -n 0 ------------------------------------------------------------------------------------


def test_n_zero_is_a_prefill_for_run_and_refused_elsewhere():
    assert parsed("run", "-n", "0").max_tokens == 0
    with pytest.raises(BadArgument, match="-n 0 is invalid"):
        parsed("chat", "-n", "0")
    with pytest.raises(BadArgument, match="-n -2 is invalid"):
        parsed("run", "-n", "-2")


def test_n_zero_prints_the_prefill_timing(tiny, capfd):
    """In process, on the synthetic model (no chat template: the prompt goes raw)."""
    code = main(["run", "-m", str(tiny), "--device", "cpu", "-c", "64", "-n", "0", "-p",
                 "one two three"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert out == "\n"  # nothing generated
    m = re.search(r"prompt (\d+) tok in ([\d.]+) ms .* generated 0 tok.*finish: length", err)
    assert m, err
    assert int(m[1]) >= 3 and float(m[2]) > 0


def test_run_with_ctx_parses_the_model_once(tiny, capfd, monkeypatch):
    """--ctx has the CLI read the training context before the load (ctx_warning): the load
    takes that parse (GGUFFile.keep / open) instead of parsing the header again."""
    made = []
    real = GGUFFile.__init__
    monkeypatch.setattr(GGUFFile, "__init__", lambda self, p: made.append(p) or real(self, p))
    code = main(["run", "-m", str(tiny), "--device", "cpu", "-c", "64", "-n", "0", "-p", "a"])
    assert code == 0, capfd.readouterr().err
    assert len(made) == 1, made


def test_a_kept_parse_serves_one_open_of_the_unchanged_file(tiny, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny.read_bytes())
    gf = GGUFFile(copy)
    gf.keep()
    assert GGUFFile.open(copy) is gf
    assert GGUFFile.open(copy) is not gf  # taken once
    gf.keep()
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a changed file
    fresh = GGUFFile.open(copy)
    assert fresh is not gf and fresh.metadata == gf.metadata


# --- quantize takes what -m takes ------------------------------------------------------------


def test_quantize_takes_a_cached_name(cache, tmp_path, capfd):
    dst = tmp_path / "out-q4_0.gguf"
    assert main(["quantize", "tiny-habits", str(dst), "Q4_0"]) == 0, capfd.readouterr().err
    assert capfd.readouterr().out.strip() == str(dst)
    types = {t.ggml_type.name for t in GGUFFile(dst).tensors.values()}
    assert "Q4_0" in types


def test_quantize_of_an_unknown_name_is_one_line(cache, tmp_path, capfd):
    assert main(["quantize", "no-such-model", str(tmp_path / "x.gguf"), "Q4_0"]) == 1
    assert "model 'no-such-model' does not exist" in capfd.readouterr().err


# --- warnings --------------------------------------------------------------------------------


def test_ctx_beyond_training_warns_with_both_numbers_and_the_kv_size(tiny):
    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    gf.close()
    assert ctx_warning(tiny, cfg.context_length, 4) is None
    assert ctx_warning(tiny, None, 4) is None
    ctx = cfg.context_length * 4
    text = ctx_warning(tiny, ctx, 4)
    kv = kv_cache_bytes(cfg, cfg.n_layers, ctx, 4)
    assert f"--ctx {ctx}" in text and f"the {cfg.context_length} tokens" in text
    assert f"{kv / 2**20:.2f} MiB" in text, text


def test_gpu_flags_on_a_cpu_warn(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a = parse_args(build_parser(), ["run", "-ngl", "99", "--vram-budget", "8GiB"])
    text = gpu_flags_warning(a)
    assert text.startswith("-ngl 99, --vram-budget 8GiB have no effect") and "no CUDA" in text
    assert gpu_flags_warning(parse_args(build_parser(), ["run"])) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_flags_warning(a) is None  # auto picks the GPU: the flags apply
    a = parse_args(build_parser(), ["run", "-ngl", "99", "--device", "cpu"])
    assert "--device cpu" in gpu_flags_warning(a)


@pytest.mark.slow
def test_the_warnings_print_one_line_each_before_the_run(tiny):
    r = subprocess.run([sys.executable, "-m", "slipstream", "run", "-m", str(tiny), "--device",
                        "cpu", "-ngl", "99", "-c", "4096", "-n", "2", "-p", "a"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(lines) == 2, r.stderr
    assert "-ngl 99 has no effect" in lines[0] and "--ctx 4096 is beyond the 2048" in lines[1]


# --- chat by default -------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_run_on_an_instruct_model_chats_and_raw_completes(smollm_path):
    """The default model has a chat template: `run` sends the prompt as a user message (the
    same text as the API's chat), `--raw` completes it (the API's generate)."""
    import slipstream

    with slipstream.load(smollm_path, device="cpu", ctx=256) as model:
        assert not model.template.is_fallback
        chat = "".join(e.text for e in model.chat([{"role": "user", "content": "Hello"}],
                                                  max_tokens=12, temperature=0))
        raw = "".join(e.text for e in model.generate("Hello", max_tokens=12, temperature=0))
    common = ("--device", "cpu", "-c", "256", "-n", "12", "--temp", "0")
    r = cli("run", str(smollm_path), "Hello", *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout == chat + "\n" and chat != raw
    r = cli("run", str(smollm_path), "Hello", "--raw", *common)
    assert r.returncode == 0, r.stderr
    assert r.stdout == raw + "\n"


def test_the_engine_import_leaves_the_collector_on_and_the_imports_frozen():
    """cli.loading.import_engine: torch and the engine imported with the cyclic collector
    paused, then everything made so far frozen out of its full passes, and the collector back
    on (a command that forgot it would leak every cycle it makes)."""
    import gc

    from slipstream.cli import loading

    gc.unfreeze()
    try:
        api = loading.import_engine()
        assert gc.isenabled() and gc.get_freeze_count() > 0 and callable(api.load)
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
