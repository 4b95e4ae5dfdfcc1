"""Every model a README example names exists where the example runs (fast: nothing loads).

tests/test_readme_examples.py runs the examples in a fresh directory whose cache holds the
default model alone, plus the files an `<!-- example: files NAME=TYPE -->` marker makes. An
example that names another file (`slipstream.load("target.gguf")`) fails there with
ModelNotFound; this finds it without running anything: each name a command passes as a model
(`-m`, `--draft`, run's positionals, quantize's SRC, `slipstream.load(...)`) must be a marker's
file, a file an earlier command of the block wrote (quantize's DST, synth's -o), or a name the
real resolver finds in such a cache, offline."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from slipstream.cli.rules import names_a_model
from slipstream.hub.pull import resolve
from slipstream.hub.refs import parse_ref
from slipstream.hub.store import DEFAULT_FILENAME, GGUF_MAGIC
from test_readme_examples import BLOCKS, Block

MODEL_FLAGS = {"-m", "--model", "--draft"}
# run's options that take a value, so that their values are not taken for positionals
RUN_VALUED = {"-p", "--prompt", "-f", "--file", "-n", "--max-tokens", "-c", "--ctx", "--device",
              "--ram-budget", "--vram-budget", "--gpus", "--devices", "-ngl", "--vram-layers",
              "--gpu-slots", "--precision", "--io", "--skip-layers", "-t", "--threads",
              "--hybrid", "--trace", "--temp", "--top-k", "--top-p", "--min-p", "--seed",
              "--stop", "--repeat-penalty", "--frequency-penalty", "--presence-penalty",
              "--draft-skip-layers", "--draft-lowbit", "--spec-nodes", "--spec-depth"}
LOAD = re.compile(r"slipstream\.load\(\s*(?:path\s*=\s*)?[\"']([^\"']+)[\"']")


def model_names(block: Block) -> tuple[list[str], set[str]]:
    """(the names the block's commands pass as models, the files its commands write)."""
    if block.lang == "python":
        return LOAD.findall(block.code), set()
    named, made = [], set()
    for cmd in block.commands():
        for part in re.split(r"&&|\|\||;|\|", cmd):
            words = shlex.split(part, comments=True)
            if "slipstream" not in words:
                continue
            words = words[words.index("slipstream") + 1:]
            if not words:
                continue
            sub, rest = words[0], words[1:]
            named += [v for f, v in zip(rest, rest[1:]) if f in MODEL_FLAGS]
            if sub == "quantize" and len(rest) >= 2:
                named.append(rest[0])
                made.add(rest[1])
            if sub == "synth":
                made |= {v for f, v in zip(rest, rest[1:]) if f in ("-o", "--output")}
            if sub == "run":
                positionals = [w for i, w in enumerate(rest) if not w.startswith("-")
                               and (i == 0 or rest[i - 1] not in RUN_VALUED | MODEL_FLAGS)]
                # two: the model and the prompt; one is the model only if it names one
                named += positionals[:1] if len(positionals) == 2 else \
                    [w for w in positionals if w.endswith(".gguf")]
    return named, made


def missing_models(block: Block, cwd: Path) -> list[str]:
    """The names the block passes as models that its run would not find (`cwd`: a fresh
    directory and cache as the README test makes them; the caller chdirs there)."""
    named, made = model_names(block)
    for name in block.files:
        (cwd / name).write_bytes(GGUF_MAGIC)
    missing = []
    for name in named:
        if name in made or name in block.files:
            continue
        if parse_ref(name) is not None:  # a Hub file or URL: the examples download nothing
            missing.append(name)
            continue
        try:
            resolve(name, quiet=True)
        except Exception as e:  # ModelNotFound, or a pull the offline cache refuses
            missing.append(f"{name} ({type(e).__name__})")
    return missing


@pytest.fixture
def fresh(tmp_path, monkeypatch) -> Path:
    """A cache with the default model's name in it (a stub: nothing is loaded) and an empty
    working directory, offline."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / DEFAULT_FILENAME).write_bytes(GGUF_MAGIC)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


RUNNABLE = [b for b in BLOCKS if not b.skip and not b.errors]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_every_model_an_example_names_exists(block, fresh):
    assert not missing_models(block, fresh), (
        f"README {block.id} names models its run would not find; give them a "
        f"`<!-- example: files NAME=TYPE -->` marker or name a cached model:\n{block.code}")


def test_the_check_finds_a_missing_model(fresh):
    """The check fails where the example would: a file nobody made, in either language."""
    python = Block(1, "python", 'import slipstream\nm = slipstream.load("target.gguf")\n')
    assert missing_models(python, fresh) == ["target.gguf (ModelNotFound)"]
    bash = Block(2, "bash", 'slipstream run -m target.gguf -p "hi"\n'
                            'slipstream run other.gguf "hi" -n 4\n')
    assert missing_models(bash, fresh) == ["target.gguf (ModelNotFound)",
                                           "other.gguf (ModelNotFound)"]
    made = Block(3, "bash", "slipstream quantize SmolLM2-135M-Instruct.Q4_1 d.gguf Q4_0\n"
                            "slipstream run -m d.gguf --draft d.gguf\n")
    assert missing_models(made, fresh) == []
    marked = Block(4, "bash", "slipstream run -m mine.gguf\n", files={"mine.gguf": "Q8_0"})
    assert missing_models(marked, fresh) == []
    assert names_a_model("SmolLM2-135M-Instruct.Q4_1")  # the cache's default, by its name
