"""memory.resident_image: a resident CPU model's packed decode copies, written once to an image
beside the model and mapped at later loads, give the bits of copies packed in memory (the
packers' own output, which tests/weights/test_cpu_packed.py checks against
gguf.quants.dequantize); a damaged image is rebuilt; two loads at once write one image; `rm`
removes it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.errors import ImageFileError, SlipstreamWarning
from slipstream.hub.store import written_beside
from slipstream.memory import resident_image
from slipstream.memory.image_file import image_paths
from slipstream.synth import write_synth
from slipstream.weights import loader
from slipstream.weights.cpu import PackedDecodeLinear

SHORT = [5, 77, 300, 12, 901, 44, 7, 8]  # 8 tokens: one pass through the packed decode path
LONG = SHORT + [3, 1000, 64, 2, 17]  # 13: a prefill pass, dense


@pytest.fixture(autouse=True)
def _images_for_tiny_files(monkeypatch):
    """These files are far below the size "auto" writes images for: force them."""
    monkeypatch.setenv("SLIPSTREAM_CPU_IMAGE", "1")


@pytest.fixture(scope="module", params=["Q4_K_M", pytest.param("Q8_0", marks=pytest.mark.slow),
                                        pytest.param("Q4_0", marks=pytest.mark.slow)])
def synth(request, tmp_path_factory):
    # Q4_K_M: q/k/v mix Q4_K and Q6_K (a packed copy per part: weights.cpu.parts), Q4_K
    # gate/up (q4vnni or int4pack), Q6_K down (q6vnni or int8pack), a Q6_K head
    d = tmp_path_factory.mktemp("resident-image")
    return write_synth(d / "tiny.gguf", "tiny", request.param, n_layers=3, from_floats=True,
                       std=0.08, seed=7)


@pytest.fixture
def model(synth, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(synth, path)
    return path


def data_file(path: Path, n_layers: int = 3) -> Path:
    return image_paths(path, resident_image.KIND, layers=range(n_layers + 1))[0]


def outputs(m) -> list:
    return [m.logits(SHORT), m.logits(LONG), m.logits(SHORT, one_at_a_time=True),
            [e.id for e in m.generate(SHORT, max_tokens=6, temperature=0)]]


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(a, b))


def packed(m) -> list[PackedDecodeLinear]:
    groups = resident_image.resident_linears(m.engine.weights.layers, m.engine.weights.output,
                                             m.config.n_layers)
    return [lin for g in groups.values() for lin in g.values()]


def kind(lin: PackedDecodeLinear) -> str:
    return "none" if lin.packed is lin.dense else lin.packed.kind


def test_an_image_load_gives_the_bits_of_copies_packed_in_memory(model, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CPU_IMAGE", "0")
    in_memory = slipstream.load(model, device="cpu", ctx=64)
    fresh = outputs(in_memory)
    assert not data_file(model).exists()  # off: none written
    monkeypatch.setenv("SLIPSTREAM_CPU_IMAGE", "1")
    first = slipstream.load(model, device="cpu", ctx=64)  # packs, writes, maps
    assert first.engine.weights.packed_image.path == data_file(model)
    assert same(outputs(first), fresh)

    def no_packing(*a, **k):
        raise AssertionError("a load from the image packed a weight")

    monkeypatch.setattr(loader, "pack_joined", no_packing)
    again = slipstream.load(model, device="cpu", ctx=64)
    image = again.engine.weights.packed_image
    lo = image.buffer.data_ptr()
    hi = lo + image.buffer.numel()
    for lin, ref in zip(packed(again), packed(in_memory), strict=True):
        assert lin.is_packed  # given at load, not packed at the first step
        assert kind(lin) == kind(ref)
        if lin.packed is lin.dense:
            continue
        planes = [t for p in getattr(lin.packed, "parts", [lin.packed])
                  for t in vars(p).values() if isinstance(t, torch.Tensor)]
        assert planes and all(lo <= t.data_ptr() < hi for t in planes)  # views of the map
    assert same(outputs(again), fresh)


def test_a_truncated_or_damaged_image_is_rebuilt(model):
    fresh = outputs(slipstream.load(model, device="cpu", ctx=64))
    data = data_file(model)
    size = data.stat().st_size
    os.truncate(data, size // 2)
    assert same(outputs(slipstream.load(model, device="cpu", ctx=64)), fresh)
    assert data.stat().st_size == size
    # the same size and mtime, other bytes (the first page is always among those sampled)
    st = data.stat()
    with open(data, "r+b") as f:
        first = f.read(64)
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in first))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert same(outputs(slipstream.load(model, device="cpu", ctx=64)), fresh)
    with open(data, "rb") as f:
        assert f.read(64) == first  # rebuilt


def test_a_stale_identity_rebuilds_and_an_unwritable_image_warns(model, monkeypatch):
    slipstream.load(model, device="cpu", ctx=64)
    index = data_file(model).with_suffix(".json")
    doc = json.loads(index.read_text())
    doc["model"]["version"] = -1  # written by another packing version
    index.write_text(json.dumps(doc))
    slipstream.load(model, device="cpu", ctx=64)
    assert json.loads(index.read_text())["model"]["version"] != -1

    index.unlink()

    def refuse(data, *a, **k):
        raise ImageFileError(f"cannot write the layer images at {data}: read-only")

    monkeypatch.setattr(resident_image, "write_images", refuse)
    monkeypatch.setenv("SLIPSTREAM_CPU_IMAGE", "0")
    fresh = outputs(slipstream.load(model, device="cpu", ctx=64))
    monkeypatch.setenv("SLIPSTREAM_CPU_IMAGE", "1")
    with pytest.warns(SlipstreamWarning, match="stay unsaved.*read-only"):
        m = slipstream.load(model, device="cpu", ctx=64)
    assert m.engine.weights.packed_image is None
    assert same(outputs(m), fresh)


LOAD_ONE = """
import hashlib, os, sys, time
import slipstream
from slipstream.memory import resident_image
real = resident_image.write_images
def counted(*a, **k):
    print("wrote", flush=True)
    time.sleep(1)  # holding the lock: the other load gets there meanwhile
    return real(*a, **k)
resident_image.write_images = counted
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):  # both start loading at once
    time.sleep(0.01)
m = slipstream.load(sys.argv[1], device="cpu", ctx=64)
img = m.engine.weights.packed_image
print("inode", os.stat(img.path).st_ino)
print("logits", hashlib.sha1(m.logits([5, 77, 300, 12]).numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_two_loads_at_once_write_one_image(model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    go = model.parent / "go"
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_ONE, str(model), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [out.splitlines() for out, _ in outs]
    assert sum(ls.count("wrote") for ls in lines) == 1  # the other waited, then mapped it
    assert len({ls[-2] for ls in lines}) == 1  # both mapped the one file
    assert len({ls[-1] for ls in lines}) == 1
    beside = sorted(p.name for p in model.parent.iterdir())
    assert [n for n in beside if n.endswith(".tmp")] == []
    assert [n for n in beside if n.endswith(".img")] == [data_file(model).name]
    go.unlink()


def test_rm_removes_the_resident_image(synth, tmp_path, monkeypatch, capsys):
    from slipstream import cli

    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "cache" / "m.gguf"
    path.parent.mkdir()
    shutil.copy(synth, path)
    slipstream.load(path, device="cpu", ctx=64)
    written = written_beside(path)
    assert data_file(path) in written and data_file(path).with_suffix(".json") in written
    assert cli.main(["rm", "m.gguf"]) == 0, capsys.readouterr().err
    assert [p.name for p in path.parent.iterdir() if p.name.startswith("m.gguf")] == []


def test_auto_writes_images_only_for_files_worth_it(tmp_path, monkeypatch):
    """SLIPSTREAM_CPU_IMAGE=auto (the default) leaves a small file's packing in memory, where
    writing the image costs more than packing (the default model: 1.01 s against 0.34 s), and
    gives one from AUTO_MIN_MODEL_BYTES on; 0 and 1 decide alone."""
    from slipstream.memory import resident_image

    small = tmp_path / "small.gguf"
    small.write_bytes(b"\0" * 1024)
    assert not resident_image.image_wanted(small, "auto")
    assert resident_image.image_wanted(small, True)
    monkeypatch.setattr(resident_image, "AUTO_MIN_MODEL_BYTES", 1024)
    assert resident_image.image_wanted(small, "auto")
    assert not resident_image.image_wanted(small, False)
    monkeypatch.delenv("SLIPSTREAM_CPU_IMAGE")
    from slipstream import envs
    assert envs.get("SLIPSTREAM_CPU_IMAGE") == "auto"
