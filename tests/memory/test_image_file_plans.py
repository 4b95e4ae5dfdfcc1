"""Image files shared by processes: each plan (the layers it streams) has a file of its own,
written under a lock to a temporary name and renamed into place, so two runs of one model with
different budgets never read each other's file nor a partial one; filesystem failures are one
ImageFileError naming the path (memory.image_file)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from slipstream.errors import ImageFileError
from slipstream.memory import image_file
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.cpu_image import cpu_image_of, image_nbytes

FAST = Precision.of("fast", torch.device("cpu"))
TIMEOUT = 300  # a model load takes seconds on a free core, much longer on a busy one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("image-plans")
    return write_synth(d / "tiny.gguf", "tiny", "Q4_K", n_layers=6, from_floats=True, std=0.08,
                       seed=11)


@pytest.fixture
def model(tiny, tmp_path) -> Path:
    path = tmp_path / "m.gguf"
    shutil.copy(tiny, path)
    return path


def test_each_plan_names_a_file_of_its_own(model):
    def data(layers):
        return image_file.image_paths(model, "slipstream-cpu", layers=layers)[0]

    assert data([3, 4, 5]) == data([5, 3, 4]) == model.with_name("m.gguf.slipstream-cpu.L3-5.img")
    assert len({data([3, 4, 5]), data([4, 5]), data([0, 2]), data([0, 3]), data([0])}) == 5
    assert data([0, 2]).name.startswith("m.gguf.slipstream-cpu.H")  # not one run: hashed
    assert image_file.image_paths(model, layers=[3, 4, 5])[0] != data([3, 4, 5])  # CUDA's
    with pytest.raises(ValueError):
        image_file.plan_key([])


def test_a_file_being_written_is_invisible_and_one_plan_is_written_once(model, monkeypatch):
    """While one thread writes plan [4, 5] (held inside its first layer): no data or index
    file of that plan exists, a reader finds none, a second writer of the same plan waits,
    and a writer of another plan finishes meanwhile. Then both writers of [4, 5] get the
    one file, whose bytes are the packed layers'. (flock excludes open file descriptions, so
    threads stand in for processes.)"""
    gf = GGUFFile(model)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    sizes = [image_nbytes(gf, cfg, i, FAST) for i in range(cfg.n_layers)]
    held, go = threading.Event(), threading.Event()
    made: list[int] = []

    def slow_pack(gf_, cfg_, precision, i):
        made.append(i)
        if len(made) == 1:
            held.set()
            assert go.wait(30)
        return cpu_image_of(gf_, cfg_, precision, i)

    monkeypatch.setattr(image_file, "cpu_image_of", slow_pack)
    results: dict[str, object] = {}

    def build(name: str, layers: list[int]) -> None:
        try:
            results[name] = image_file.build_cpu_images(gf, cfg, FAST, layers, sizes,
                                                        progress=False)
        except Exception as e:  # reported by the asserts below
            results[name] = e

    first = threading.Thread(target=build, args=("first", [4, 5]))
    first.start()
    try:
        assert held.wait(60)
        data, index = image_file.image_paths(model, "slipstream-cpu", layers=[4, 5])
        assert not data.exists() and not index.exists()
        assert image_file.open_cpu_images(model, [4, 5]) is None
        assert len(list(model.parent.glob(data.name + ".*.tmp"))) == 1  # its temporary file
        second = threading.Thread(target=build, args=("second", [4, 5]))
        second.start()
        build("other", [5])  # another plan: another lock, not held up
        assert isinstance(results["other"], image_file.ImageFile), results["other"]
        second.join(0.3)
        assert second.is_alive() and "second" not in results  # waits for the lock
    finally:
        go.set()
        first.join(60)
    second.join(60)
    assert sorted(made) == [4, 5, 5]  # [4, 5] packed once, by the first writer; [5] once
    a, b = results["first"], results["second"]
    assert isinstance(a, image_file.ImageFile) and isinstance(b, image_file.ImageFile), results
    assert a.path == b.path == data and a.spans == b.spans and a.fingerprints == b.fingerprints
    assert results["other"].path != data
    raw = data.read_bytes()
    for i, (start, end) in a.spans.items():
        assert raw[start:end] == cpu_image_of(gf, cfg, FAST, i)[0].numpy().tobytes()
    assert not list(model.parent.glob("*.tmp"))
    gf.close()


def _write(data: Path) -> None:
    image = torch.arange(5000, dtype=torch.uint8)
    image_file.write_images(data, data.with_suffix(".json"), {"v": 1}, [0], [image.numel()],
                            lambda i: (image, {}), "test", progress=False)


def test_filesystem_failures_are_one_error_naming_the_path(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    data = blocker / "images" / "m.gguf.slipstream-cpu.L0-0.img"  # ENOTDIR, for root too
    with pytest.raises(ImageFileError, match=f"{data}: Not a directory; .*SLIPSTREAM_CACHE"):
        _write(data)
    # a full disk mid-write: the advice is space, and the temporary file is gone
    data = tmp_path / "m.gguf.slipstream-cpu.L0-0.img"

    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(image_file.os, "pwrite", full)
    with pytest.raises(ImageFileError, match=r"m\.gguf\.slipstream-cpu\.L0-0\.img\..*\.tmp: "
                                             r"No space left on device; free space in"):
        _write(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    monkeypatch.undo()
    _write(data)  # and where the folder is usable, it is written
    assert data.stat().st_size == 8192 and data.read_bytes()[:5000] == bytes(range(256)) * 19 \
        + bytes(range(136))


# --- real processes -------------------------------------------------------------------------


def _cli(model: Path, *args: str, env: dict | None = None,
         prefix: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream", "run", "-m", str(model), "--device", "cpu",
           "-t", "1", "--ctx", "64", "-n", "12", "--temp", "0", "-p", "Once upon a time",
           *args]
    return subprocess.Popen((prefix or []) + cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _done(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=TIMEOUT)
    return p.returncode, out, err


@pytest.mark.slow
def test_two_processes_with_different_budgets_stream_one_model_at_once(tmp_path):
    """Started together, both write their plan's image file beside the model at the same time
    (32 layers: packing them takes seconds, longer than the two loads differ by; were the two
    plans to share one file, one run would fail, with a FileNotFoundError traceback or a
    changed file); both give the resident run's text."""
    from helpers import cpu_budget

    model = write_synth(tmp_path / "m.gguf", "tiny", "Q4_K", n_layers=32, from_floats=True,
                        std=0.08, seed=11)
    budgets = [cpu_budget(model, packed=0), cpu_budget(model, packed=16)]
    procs = [_cli(model, "--ram-budget", str(b), "-n", "4") for b in budgets] + \
        [_cli(model, "-n", "4")]
    (rc1, out1, err1), (rc2, out2, err2), (rc0, resident, err0) = [_done(p) for p in procs]
    assert rc0 == 0, err0
    assert rc1 == 0 and "Traceback" not in err1, err1
    assert rc2 == 0 and "Traceback" not in err2, err2
    assert out1 == resident and out2 == resident and resident.strip()
    assert sorted(p.name for p in model.parent.glob("m.gguf.slipstream-cpu.*.img")) == \
        ["m.gguf.slipstream-cpu.L0-31.img", "m.gguf.slipstream-cpu.L16-31.img"]


def _read_only(folder: Path) -> list[str]:
    """A command prefix under which `folder` is read-only: none where chmod is enough (not
    root), else a private mount namespace with a read-only bind mount of it (root ignores
    permission bits); skips when neither is possible."""
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return []
    folder.chmod(0o755)
    prefix = ["unshare", "-m", "sh", "-c",
              'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(folder)]
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare: cannot make a folder read-only")
    probe = subprocess.run(prefix + ["touch", str(folder / "probe")], capture_output=True)
    if probe.returncode == 0 or (folder / "probe").exists():
        pytest.skip(f"a read-only bind mount is not possible here: {probe.stderr!r}")
    return prefix


@pytest.mark.slow
def test_a_read_only_model_folder_uses_the_cache_and_both_unusable_is_one_line(model,
                                                                             tmp_path):
    from helpers import cpu_budget

    budget = str(cpu_budget(model, packed=0))
    prefix = _read_only(model.parent)
    try:
        cache = tmp_path.parent / (tmp_path.name + "-cache")  # outside the read-only folder
        rc, out, err = _done(_cli(model, "--ram-budget", budget, prefix=prefix,
                                  env={"SLIPSTREAM_CACHE": str(cache)}))
        assert rc == 0 and out.strip(), err
        assert [p.name.split(".slipstream-cpu.")[1]
                for p in (cache / "images").glob("m.gguf.*.img")] == ["L0-5.img"]
        blocker = tmp_path.parent / (tmp_path.name + "-file")
        blocker.write_text("a file, not a folder")
        rc, out, err = _done(_cli(model, "--ram-budget", budget, prefix=prefix,
                                  env={"SLIPSTREAM_CACHE": str(blocker / "cache")}))
    finally:
        model.parent.chmod(0o755)
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot write the layer images at {blocker}/cache/")
    assert "SLIPSTREAM_CACHE" in lines[0]
