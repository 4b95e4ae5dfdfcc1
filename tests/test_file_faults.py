"""A model file changed under a running model: truncated, overwritten in place (with
and without its modification time restored), or deleted, in the middle of a generation.

Each case runs in a subprocess, so that a SIGBUS shows as a negative return code instead of
killing pytest. What must hold:
- a resident CPU model (weights in private memory, the default on CPU) never reads its file
  again: every fault leaves its output unchanged;
- a streamed model detects a change (size, modification time, or a sampled checksum of what it
  reads) of a file it reads and stops with FileChanged naming the file; a deleted file reads
  on through the open descriptor, output unchanged. At "exact" every pass reads the model
  file; at "fast" decode passes read the packed layer images written at load (MODEL.slipstream-
  cpu.img) and only prefill passes of more than 8 tokens read the model file, so each file's
  faults are caught at its next read.
The controls load the resident model with private_weights=False (its embedding a view of the
file's map): a truncation then kills it by SIGBUS and an overwrite changes its output, which
shows that the faults reach the bytes the model uses.
The --io mmap stores (the CPU's MmapLayerStore, CUDA's MmapSource) read through positional reads
now, not a map: a file truncated right before a layer's read must be FileChanged, not SIGBUS.
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

from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth

CHILD = r'''
import json, os, sys
import slipstream
from slipstream.errors import SlipstreamError
from slipstream.modelfile.gguf_file import GGUFFile

args = json.loads(sys.argv[1])
path = args["path"]
place = {}
if args.get("ram_budget"):
    place["ram_budget"] = args["ram_budget"]
if args.get("private") is not None:
    place["private_weights"] = args["private"]
if args.get("io"):
    place["io"] = args["io"]
model = slipstream.load(path, device="cpu", ctx=64, precision=args.get("precision") or "fast",
                        placement=slipstream.Placement(**place))
prompt = args["prompt"]
n = args["tokens"]


def greedy():
    return [e.id for e in model.generate(prompt, max_tokens=n, temperature=0)]


def fault(kind):
    path = args["fault_path"]  # the model file, or its packed layer images
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


def data_offset(path: Path) -> int:
    gf = GGUFFile(path)
    start = gf.reader.data_offset  # where the tensor data starts, after the header
    gf.close()
    return start


def run_child(path: Path, fault: str, prompt, ram_budget=None, private=None, io=None,
              precision=None, target: Path | None = None) -> dict:
    """Run one fault case; returns the child's result (fails the test on a signal). The fault
    hits `target` (default: the model file's tensor data)."""
    args = {"path": str(path), "fault": fault, "prompt": prompt, "tokens": TOKENS,
            "ram_budget": ram_budget, "private": private, "io": io, "precision": precision,
            "fault_path": str(target or path),
            "fault_start": 0 if target else data_offset(path)}
    return run_script(CHILD, args)


def run_script(script: str, args: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True,
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

@pytest.mark.slow
@pytest.mark.parametrize("fault", ["truncate", "overwrite", "delete"])
def test_resident_model_is_unaffected(model_copy, fault):
    r = assert_clean(run_child(model_copy, fault, PROMPT))
    assert set(r["plan"]) == {"ram"}
    assert r["error"] is None, r["error"]
    assert r["got"] == r["ref"] and r["after"] == r["ref"]


@pytest.mark.slow
def test_control_mapped_resident_model_dies_by_sigbus_on_truncation(model_copy):
    """Without private weights the embedding reads the file's map: the truncation kills it.
    (This is what the default prevents; it also proves the fault reaches the model's bytes.)"""
    run = run_child(model_copy, "truncate", PROMPT, private=False)
    assert run["returncode"] == -signal.SIGBUS, run


@pytest.mark.slow
def test_control_mapped_resident_model_changes_on_overwrite(model_copy):
    run = run_child(model_copy, "overwrite", PROMPT, private=False)
    r = assert_clean(run)
    # a silent change (or NaN logits, caught as an error): either way not the reference
    assert r["error"] is not None or r["got"] != r["ref"] or r["after"] != r["ref"]


# --- streamed: a change is detected; a deletion is not a change ------------------------------

TINY_LONG_PROMPT = TINY_PROMPT + [3, 1000, 64, 2]  # over 8 tokens: a prefill pass


def all_streamed(path: Path, precision: str) -> int:
    """A RAM budget that streams every layer of the model from disk each token."""
    from helpers import cpu_budget

    return cpu_budget(path, precision=precision)


def cpu_images(path: Path) -> Path:
    """The packed image file of a plan that streams all 6 layers (the tiny model's)."""
    from slipstream.memory.image_file import image_paths

    return image_paths(path, "slipstream-cpu", layers=range(6))[0]


CHANGED = {"truncate": "truncated or replaced while running",
           "overwrite": "rewritten while running",
           "overwrite_keep_mtime": "differ from their first read"}
# the images' index holds their checksums as written, which their first read is checked against
CHANGED_IMAGE = dict(CHANGED, overwrite_keep_mtime="differ from what was written there")


def assert_changed(r: dict, changed: Path, expected: str) -> None:
    assert "disk" in r["plan"]
    assert r["error"] is not None, "the change went unnoticed"
    assert r["error"]["type"] == "FileChanged"
    assert str(changed) in r["error"]["message"]
    assert expected in r["error"]["message"]
    # the tokens it did give came from the file as it was
    assert r["got"] == r["ref"][:len(r["got"])]


@pytest.mark.slow
@pytest.mark.parametrize("io", ["direct", "mmap"])
@pytest.mark.parametrize("fault", ["truncate", "overwrite", "overwrite_keep_mtime"])
def test_streamed_model_detects_a_changed_file(tiny_copy, fault, io):
    """At "exact" every pass reads the model file."""
    r = assert_clean(run_child(tiny_copy, fault, TINY_PROMPT, precision="exact", io=io,
                               ram_budget=all_streamed(tiny_copy, "exact")))
    assert_changed(r, tiny_copy, CHANGED[fault])


@pytest.mark.slow
@pytest.mark.parametrize("io", ["direct", "mmap"])
@pytest.mark.parametrize("fault", ["truncate", "overwrite", "overwrite_keep_mtime"])
def test_streamed_packed_model_detects_a_changed_image_file(tiny_copy, fault, io):
    """At "fast" decode reads the packed layer images."""
    r = assert_clean(run_child(tiny_copy, fault, TINY_PROMPT, io=io, target=cpu_images(tiny_copy),
                               ram_budget=all_streamed(tiny_copy, "fast")))
    assert_changed(r, cpu_images(tiny_copy), CHANGED_IMAGE[fault])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["truncate", "overwrite", "overwrite_keep_mtime"])
def test_streamed_packed_model_detects_a_changed_model_file_at_its_next_prefill(tiny_copy,
                                                                                fault,
                                                                                monkeypatch):
    """Without packed prefill (SLIPSTREAM_PACKED_PREFILL=0) a prefill pass rebuilds the
    streamed layers from the model file."""
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", "0")  # (the child inherits it)
    r = assert_clean(run_child(tiny_copy, fault, TINY_LONG_PROMPT,
                               ram_budget=all_streamed(tiny_copy, "fast")))
    assert_changed(r, tiny_copy, CHANGED[fault])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["truncate", "overwrite"])
def test_streamed_packed_model_prefills_without_its_model_file(tiny_copy, fault):
    """With packed prefill (the default) Q4_K layers prefill from their images, as they
    decode: the model file is not read after the load, so a change to it goes unnoticed and
    changes nothing, as for a resident model."""
    r = assert_clean(run_child(tiny_copy, fault, TINY_LONG_PROMPT,
                               ram_budget=all_streamed(tiny_copy, "fast")))
    assert set(r["plan"]) == {"disk"}
    assert r["error"] is None, r["error"]
    assert r["got"] == r["ref"] and r["after"] == r["ref"]


@pytest.mark.slow
@pytest.mark.parametrize("io", ["direct", "mmap"])
@pytest.mark.parametrize("precision,images", [("exact", False), ("fast", True)])
def test_streamed_model_reads_on_after_deletion(tiny_copy, io, precision, images):
    target = cpu_images(tiny_copy) if images else None
    r = assert_clean(run_child(tiny_copy, "delete", TINY_PROMPT, io=io, precision=precision,
                               target=target, ram_budget=all_streamed(tiny_copy, precision)))
    assert "disk" in r["plan"]
    assert r["error"] is None, r["error"]
    assert r["got"] == r["ref"] and r["after"] == r["ref"]
    assert not (target or tiny_copy).exists()


# --- --io mmap: positional reads, so a truncation right before a read is no SIGBUS ----------

MMAP_CHILD = r'''
import json, os, sys
import torch
from slipstream.errors import SlipstreamError
from slipstream.memory.disk import FileWatch

args = json.loads(sys.argv[1])
path = args["path"]
armed, cut = [False], []


def cut_now():
    """Truncate the file to args["cut"] bytes, once, at the first hook reached once armed."""
    if armed[0] and not cut:
        os.truncate(path, args["cut"])
        cut.append(True)


# The file shrinks at the last moment before a layer's bytes are read, whichever way the store
# reads them: right after a FileWatch check passed (the old map's copy came next), as a
# positional read starts, or as a layer's build starts (the old CPU store built from the map).
real_check, real_preadv = FileWatch.check, os.preadv


def check(self, fd):
    real_check(self, fd)
    cut_now()


def preadv(fd, buffers, offset, *flags):
    cut_now()
    return real_preadv(fd, buffers, offset, *flags)


FileWatch.check, os.preadv = check, preadv

if args["store"] == "cpu":
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.memory import MmapLayerStore
    from slipstream.precision import Precision
    from slipstream.weights.loader import LayerBuilder

    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source="tiny")
    cpu = torch.device("cpu")
    builder = LayerBuilder(cfg, cpu, Precision.of("exact", cpu))
    real_build = builder.build

    def build(src, i):
        cut_now()
        return real_build(src, i)

    builder.build = build
    store = MmapLayerStore(gf, builder, [None] * cfg.n_layers)

    def get(i):
        store.acquire(i)
        store.release(i)
else:  # CUDA's MmapSource, driven on the CPU (its slot a CPU tensor, no stream)
    from slipstream.memory.image_file import ImageFile
    from slipstream.memory.protocol import StoreStats
    from slipstream.memory.sources import MmapSource

    spans = {0: (0, 4096), 1: (4096, 8192)}
    store = MmapSource(ImageFile(path, spans, {0: None, 1: None}), StoreStats(), 4096,
                       torch.device("cpu"), drop_cache=False)

    def get(i):
        store.acquire(i, None)

get(0)  # a clean read first
armed[0] = True
out = {"error": None}
try:
    get(1)
except SlipstreamError as e:
    out["error"] = {"type": type(e).__name__, "message": str(e)}
out["cut"] = bool(cut)
store.close()
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("store", ["cpu", "cuda-source"])
def test_mmap_mode_truncated_right_before_a_read_is_file_changed(tiny_copy, tmp_path, store):
    """The file is truncated between the store's last check and its read of a layer's bytes:
    a read through a map would be a SIGBUS (the old code's fate: a negative return code here);
    a positional read comes back short and the reader's check names the change."""
    if store == "cpu":
        path, cut = tiny_copy, data_offset(tiny_copy)  # every layer's bytes cut off
    else:
        path, cut = tmp_path / "img", 4096  # layer 1's image, [4096, 8192), cut off
        path.write_bytes(bytes(range(256)) * 32)
    size = path.stat().st_size
    r = assert_clean(run_script(MMAP_CHILD, {"path": str(path), "store": store, "cut": cut}))
    assert r["cut"], "the hook never ran: the store read its file another way"
    assert r["error"] is not None, "the truncation went unnoticed"
    assert r["error"]["type"] == "FileChanged"
    assert str(path) in r["error"]["message"]
    assert f"its size went from {size} to {cut} bytes" in r["error"]["message"]


def test_mmap_source_catches_a_file_rewritten_during_its_read(tmp_path):
    """The mmap baseline (--io mmap on CUDA) checks the file after each layer's read, so a
    rewrite while it reads fails before the bytes reach the slot, let alone a kernel."""
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

    def rewrite():  # the reader's test hook: runs in its thread, right before the read
        with open(path, "r+b") as f:
            f.seek(4096)
            f.write(b"\xff" * 16)
        os.utime(path, ns=(1, 1))  # a distinct mtime, however coarse the clock

    src.reads.reader.delay = rewrite
    with pytest.raises(FileChanged, match="rewritten while running"):
        src.acquire(1, stream)
    assert torch.equal(src.slot, torch.tensor(list(range(256)) * 16, dtype=torch.uint8))
    src.close()
    src.close()  # a second close is a no-op


def _same_layer(a, b) -> bool:
    """Every tensor of two CPU-built layers (norms, dense weights and biases) bit-identical."""
    import dataclasses

    import torch

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if hasattr(x, "weight"):
            x, y = (x.weight, x.bias), (y.weight, y.bias)
        else:
            x, y = (x,), (y,)
        for u, v in zip(x, y):
            if (u is None) != (v is None) or (u is not None and not torch.equal(u, v)):
                return False
    return True


@pytest.mark.slow
def test_mmap_store_builds_the_same_bits_as_the_other_io_paths(tiny):
    """Unchanged file: the CPU mmap store's layers are bit-identical to the ones built from the
    file's map (as resident loading builds them) and to the disk store's (O_DIRECT or buffered
    reads), pass after pass; it counts what it read."""
    import torch

    from slipstream.modelfile.config import ModelConfig
    from slipstream.memory import DiskLayerStore, MmapLayerStore
    from slipstream.precision import Precision
    from slipstream.weights.loader import LayerBuilder, TensorSource, layer_span

    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=tiny.name)
    cpu = torch.device("cpu")
    builder = LayerBuilder(cfg, cpu, Precision.of("exact", cpu))
    want = [builder.build(TensorSource(gf), i) for i in range(cfg.n_layers)]
    resident = [want[0]] + [None] * (cfg.n_layers - 1)
    mm = MmapLayerStore(gf, builder, list(resident))
    disk = DiskLayerStore(gf, builder, list(resident), io="direct")
    for _ in range(2):
        for i in range(cfg.n_layers):
            assert _same_layer(mm.acquire(i), want[i]), i
            assert _same_layer(disk.acquire(i), want[i]), i
            mm.release(i)
            disk.release(i)
    streamed = sum(e - s for s, e in (layer_span(gf, i) for i in range(1, cfg.n_layers)))
    assert mm.stats.layers_streamed == 2 * (cfg.n_layers - 1)
    assert mm.stats.disk_bytes == 2 * streamed == disk.stats.disk_bytes
    mm.close()
    disk.close()
    mm.close()  # a second close is a no-op
    gf.close()


@pytest.mark.parametrize("drop_cache", [False, True])
def test_mmap_source_reads_the_files_bytes(tmp_path, drop_cache):
    """Unchanged file: each layer's slot holds exactly its span of the image file (unaligned
    spans included), pass after pass, skipped layers left out; bytes counted."""
    import torch

    from slipstream.memory.image_file import ImageFile
    from slipstream.memory.protocol import StoreStats
    from slipstream.memory.sources import MmapSource

    path = tmp_path / "img"
    data = bytes((k * 7 + k // 251) % 256 for k in range(5 * 4096))
    path.write_bytes(data)
    spans = {3: (0, 4096), 4: (4096, 4096 + 5000), 5: (12288 + 100, 20000)}
    stats = StoreStats()
    src = MmapSource(ImageFile(path, spans, dict.fromkeys(spans)), stats, 8192,
                     torch.device("cpu"), drop_cache=drop_cache)
    for layers in ([3, 4, 5], [3, 4, 5], [4, 5]):
        if layers != sorted(spans):
            src.skip(frozenset(sorted(spans)) - frozenset(layers))
        for i in layers:
            s, e = spans[i]
            got = src.acquire(i, None)[:e - s]
            assert bytes(got.numpy()) == data[s:e], i
            src.release(i, None)
    n = sum(e - s for s, e in spans.values())
    assert stats.disk_bytes == stats.h2d_bytes == 2 * n + n - 4096
    src.close()
