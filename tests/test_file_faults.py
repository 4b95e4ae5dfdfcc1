"""A model file changed under a running model (issue 14): truncated, overwritten in place (with
and without its modification time restored), or deleted, in the middle of a generation.

Each case runs in a subprocess, so that a SIGBUS shows as a negative return code instead of
killing pytest. What must hold:
- a resident CPU model (weights in private memory, the default on CPU) never reads its file
  again: every fault leaves its output unchanged;
- a streamed model detects a change (size, modification time, or a sampled checksum of what it
  reads) and stops with FileChanged naming the file; a deleted file reads on through the open
  descriptor, output unchanged.
The controls load the resident model with private_weights=False (its embedding a view of the
file's map): a truncation then kills it by SIGBUS and an overwrite changes its output, which
shows that the faults reach the bytes the model uses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.gguf_file import GGUFFile
from slipstream.synth import write_synth

CHILD = r'''
import json, os, sys
import slipstream
from slipstream.errors import SlipstreamError
from slipstream.gguf_file import GGUFFile

args = json.loads(sys.argv[1])
path = args["path"]
kw = dict(device="cpu", ctx=64)
if args.get("ram_budget"):
    kw["ram_budget"] = args["ram_budget"]
if args.get("private") is not None:
    kw["private_weights"] = args["private"]
model = slipstream.load(path, **kw)
prompt = args["prompt"]
n = args["tokens"]


def greedy():
    return [e.id for e in model.generate(prompt, max_tokens=n, temperature=0)]


def fault(kind):
    st = os.stat(path)
    start = args["fault_start"]
    if kind == "truncate":
        with open(path, "r+b") as f:
            f.truncate(start)
    elif kind in ("overwrite", "overwrite_keep_mtime"):
        with open(path, "r+b") as f:  # every byte from `start` on flipped, same size
            f.seek(start)
            data = bytearray(f.read())
            for i in range(len(data)):
                data[i] ^= 0x5A
            f.seek(start)
            f.write(data)
        if kind == "overwrite_keep_mtime":
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    elif kind == "delete":
        os.unlink(path)
    else:
        raise ValueError(kind)


out = {"ref": greedy(), "got": [], "error": None, "plan": list(model.plan.tiers)}
try:
    for k, e in enumerate(model.generate(prompt, max_tokens=n, temperature=0)):
        out["got"].append(e.id)
        if k == 1:  # mid-generation
            fault(args["fault"])
    out["after"] = greedy()  # and a whole generation after it
except SlipstreamError as e:
    out["error"] = {"type": type(e).__name__, "message": str(e)}
print("RESULT " + json.dumps(out), flush=True)
'''

TOKENS = 8


def run_child(path: Path, fault: str, prompt, ram_budget=None, private=None) -> dict:
    """Run one fault case; returns the child's result (fails the test on a signal)."""
    gf = GGUFFile(path)
    start = gf.reader.data_offset  # the faults hit the tensor data, not the header
    gf.close()
    args = {"path": str(path), "fault": fault, "prompt": prompt, "tokens": TOKENS,
            "ram_budget": ram_budget, "private": private, "fault_start": start}
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                       text=True, timeout=600, env=env)
    return {"returncode": p.returncode, "stderr": p.stderr[-3000:],
            "result": next((json.loads(ln[7:]) for ln in p.stdout.splitlines()
                            if ln.startswith("RESULT ")), None)}


def assert_clean(run: dict) -> dict:
    rc = run["returncode"]
    assert rc >= 0, f"killed by {signal.Signals(-rc).name}:\n{run['stderr']}"
    assert rc == 0 and run["result"] is not None, run["stderr"]
    return run["result"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("faults")
    return write_synth(d / "tiny.gguf", "tiny", "Q4_K", n_layers=6, from_floats=True,
                       std=0.08, seed=11)


@pytest.fixture
def model_copy(smollm_path, tmp_path) -> Path:
    path = tmp_path / smollm_path.name
    shutil.copy(smollm_path, path)
    return path


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> Path:
    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny, path)
    return path


PROMPT = "The three most useful kitchen tools are"
TINY_PROMPT = [5, 77, 300, 12, 901, 44, 7, 8]


# --- resident: private weights, output unchanged ---------------------------------------------

@pytest.mark.parametrize("fault", ["truncate", "overwrite", "delete"])
def test_resident_model_is_unaffected(model_copy, fault):
    r = assert_clean(run_child(model_copy, fault, PROMPT))
    assert set(r["plan"]) == {"ram"}
    assert r["error"] is None, r["error"]
    assert r["got"] == r["ref"] and r["after"] == r["ref"]


def test_control_mapped_resident_model_dies_by_sigbus_on_truncation(model_copy):
    """Without private weights the embedding reads the file's map: the truncation kills it.
    (This is what the default prevents; it also proves the fault reaches the model's bytes.)"""
    run = run_child(model_copy, "truncate", PROMPT, private=False)
    assert run["returncode"] == -signal.SIGBUS, run


def test_control_mapped_resident_model_changes_on_overwrite(model_copy):
    run = run_child(model_copy, "overwrite", PROMPT, private=False)
    r = assert_clean(run)
    # a silent change (or NaN logits, caught as an error): either way not the reference
    assert r["error"] is not None or r["got"] != r["ref"] or r["after"] != r["ref"]


# --- streamed: a change is detected; a deletion is not a change ------------------------------

STREAM_BUDGET = "1600KiB"  # every layer of the tiny model is read from disk each token


@pytest.mark.parametrize("fault", ["truncate", "overwrite", "overwrite_keep_mtime"])
def test_streamed_model_detects_a_changed_file(tiny_copy, fault):
    r = assert_clean(run_child(tiny_copy, fault, TINY_PROMPT, ram_budget=STREAM_BUDGET))
    assert "disk" in r["plan"]
    assert r["error"] is not None, "the change went unnoticed"
    assert r["error"]["type"] == "FileChanged"
    assert str(tiny_copy) in r["error"]["message"]
    expected = {"truncate": "truncated or replaced while running",
                "overwrite": "rewritten while running",
                "overwrite_keep_mtime": "differ from their first read"}[fault]
    assert expected in r["error"]["message"]
    # the tokens it did give came from the file as it was
    assert r["got"] == r["ref"][:len(r["got"])]


def test_streamed_model_reads_on_after_deletion(tiny_copy):
    r = assert_clean(run_child(tiny_copy, "delete", TINY_PROMPT, ram_budget=STREAM_BUDGET))
    assert "disk" in r["plan"]
    assert r["error"] is None, r["error"]
    assert r["got"] == r["ref"] and r["after"] == r["ref"]
    assert not tiny_copy.exists()


def test_mmap_source_catches_a_file_rewritten_during_its_copy(tmp_path):
    """The mmap baseline (--io mmap on CUDA) checks the file after each layer's copy too, so a
    rewrite while the copy read the map fails before any kernel reads the slot."""
    import torch

    from slipstream.memory.disk import FileChanged
    from slipstream.memory.image_file import ImageFile
    from slipstream.memory.protocol import StoreStats
    from slipstream.memory.sources import MmapSource

    path = tmp_path / "img"
    path.write_bytes(bytes(range(256)) * 32)
    disk = ImageFile(path, {0: (0, 4096), 1: (4096, 8192)}, {0: None, 1: None})
    src = MmapSource(disk, StoreStats(), 4096, torch.device("cpu"), drop_cache=False)
    stream = None
    assert torch.equal(src.acquire(0, stream), torch.tensor(list(range(256)) * 16,
                                                            dtype=torch.uint8))

    class Rewriting:  # the slot's copy, with the file rewritten in place while it runs
        def __init__(self, slot):
            self.slot = slot

        def __getitem__(self, key):
            return self

        def copy_(self, data):
            with open(path, "r+b") as f:
                f.write(b"\xff" * 16)
            os.utime(path, ns=(1, 1))  # a distinct mtime, however coarse the clock
            return self.slot

    src.slot = Rewriting(src.slot)
    with pytest.raises(FileChanged, match="rewritten while running"):
        src.acquire(1, stream)
    src.close()
