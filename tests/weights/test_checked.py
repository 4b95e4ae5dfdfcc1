"""The record of checked tensors (weights.checked): a load of an unchanged file reads only the
tensors no earlier load checked; a changed file, or one whose record is gone or damaged, is
checked whole again; a bad tensor is never recorded, so it fails at every load; an unwritable
folder keeps the record in the cache, and `rm` removes it with the model."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from slipstream.errors import CorruptTensorValues
from slipstream.hub.store import written_beside, written_path
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights import checked, checks
from slipstream.weights.loader import load_weights

CPU = torch.device("cpu")


def load(path: Path) -> None:
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    load_weights(gf, cfg, CPU, Precision.of("fast", CPU))


@pytest.fixture
def seen(monkeypatch) -> list[str]:
    """The tensors whose values the checks read, in order."""
    names: list[str] = []
    real = checks.tensor_finding

    def spy(gf, name, kind):
        names.append(name)
        return real(gf, name, kind)

    monkeypatch.setattr(checks, "tensor_finding", spy)
    return names


@pytest.fixture
def model(tmp_path) -> Path:
    return write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2)


def test_a_second_load_of_the_unchanged_file_reads_no_tensor_again(model, seen):
    load(model)
    first = list(seen)
    assert "blk.0.attn_q.weight" in first and "output_norm.weight" in first
    assert checked.passed(model) == set(first)
    seen.clear()
    load(model)
    assert seen == []


def test_a_changed_file_is_checked_whole_again(model, seen):
    load(model)
    n = len(seen)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    seen.clear()
    load(model)
    assert len(seen) == n
    assert checked.passed(model) == set(seen)


@pytest.mark.parametrize("damage", ["missing", "garbage", "other version"])
def test_a_lost_or_damaged_record_means_every_tensor_is_read(model, seen, damage, monkeypatch):
    load(model)
    n = len(seen)
    record = written_path(model, checked.KIND)
    if damage == "missing":
        record.unlink()
    elif damage == "garbage":
        record.write_text("{not json")
    else:
        monkeypatch.setattr(checked, "CHECKS_VERSION", checked.CHECKS_VERSION + 1)
    seen.clear()
    load(model)
    assert len(seen) == n


def test_a_bad_tensor_is_never_recorded_and_fails_every_load(model, tmp_path):
    load(model)  # every tensor recorded as passed ...
    info = GGUFFile(model).tensors["blk.1.ffn_down.weight"]
    data = bytearray(model.read_bytes())
    struct.pack_into("<e", data, info.offset, float("inf"))  # block 0's d (Q8_0)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    for _ in range(2):  # ... but a file of other bytes is another file: refused each time
        with pytest.raises(CorruptTensorValues, match="blk.1.ffn_down.weight"):
            load(bad)
    assert checked.passed(bad) == set()
    # the record of the good file is no record of the bad one, even copied over it
    written_path(bad, checked.KIND).write_text(written_path(model, checked.KIND).read_text())
    with pytest.raises(CorruptTensorValues):
        load(bad)


def test_a_read_only_folder_keeps_the_record_in_the_cache_and_rm_finds_it(tmp_path,
                                                                            monkeypatch, seen):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "ro"
    folder.mkdir()
    model = write_synth(folder / "m.gguf", "tiny", "Q8_0", n_layers=1)
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != folder.resolve())
    load(model)
    record = written_path(model, checked.KIND)
    assert record.parent == tmp_path / "cache" / "images" and record.exists()
    assert record in written_beside(model)
    seen.clear()
    load(model)
    assert seen == []
