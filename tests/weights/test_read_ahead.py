"""Reading a CPU model's tensor data ahead (weights.file_bytes.read_ahead, started by api.load
through runtime.build.start_reading beside the tokenizer's build): the bytes the load then
takes are the file's, a file cut short is the same GGUFError in the loader's thread, a load
that keeps no private bytes drops the read, and only a CPU model far within RAM starts one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.errors import GGUFError
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.runtime import build
from slipstream.synth import write_synth
from slipstream.weights import loader
from slipstream.weights.file_bytes import private_file_bytes, read_ahead

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return write_synth(tmp_path_factory.mktemp("ahead") / "m.gguf", "tiny", "Q4_0", seed=3,
                       n_layers=2)


def test_the_bytes_read_ahead_are_the_files(model_path):
    gf = GGUFFile(model_path)
    want, base = private_file_bytes(gf)
    read_ahead(gf)
    got, got_base = private_file_bytes(gf)
    assert got_base == base and torch.equal(got, want)
    assert "_read_ahead" not in gf.__dict__  # taken once: a second call reads again
    assert torch.equal(private_file_bytes(gf)[0], want)
    assert torch.equal(want, torch.frombuffer(bytearray(model_path.read_bytes()[base:]),
                                              dtype=torch.uint8)[:want.numel()])


def test_a_file_cut_short_fails_where_the_bytes_are_asked_for(model_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes())
    gf = GGUFFile(cut)  # the header is whole: the cut comes after it is read
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 100)
    read_ahead(gf)
    with pytest.raises(GGUFError, match="truncated while loading"):
        private_file_bytes(gf)


def test_a_load_that_keeps_no_private_bytes_drops_the_read(model_path):
    from slipstream.modelfile.config import ModelConfig
    from slipstream.precision import Precision

    gf = GGUFFile(model_path)
    read_ahead(gf)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    loader.load_weights(gf, cfg, CPU, Precision.of("fast", CPU), private=False)
    assert "_read_ahead" not in gf.__dict__


@pytest.mark.parametrize("case,started", [
    ("cpu", True), ("cuda", False), ("not private", False), ("small budget", False),
    ("bad budget", False), ("little RAM", False)])
def test_only_a_cpu_model_far_within_ram_is_read_ahead(model_path, monkeypatch, case, started):
    gf = GGUFFile(model_path)
    size = sum(t.n_bytes for t in gf.tensors.values())
    monkeypatch.setattr(build, "mem_available", lambda: 3 * size if case == "little RAM"
                        else 1 << 40)
    dev = torch.device("cuda" if case == "cuda" else "cpu")
    ram = {"small budget": size, "bad budget": "lots"}.get(case)
    build.start_reading(gf, dev, ram, False if case == "not private" else None)
    assert ("_read_ahead" in gf.__dict__) == started
    gf.close()
    assert "_read_ahead" not in gf.__dict__  # a read nobody took goes with the file


def test_a_cpu_load_reads_ahead_and_gives_the_same_logits(model_path, monkeypatch):
    ids = list(range(1, 13))
    plain = slipstream.load(model_path, device="cpu", ctx=32)
    try:
        ref = plain.logits(ids)
    finally:
        plain.close()
    calls = []
    real = read_ahead
    monkeypatch.setattr(build, "read_ahead", lambda gf: calls.append(gf) or real(gf))
    monkeypatch.setattr(build, "mem_available", lambda: 1 << 40)
    m = slipstream.load(model_path, device="cpu", ctx=32)
    try:
        assert len(calls) == 1 and "_read_ahead" not in calls[0].__dict__  # taken by the load
        assert torch.equal(m.logits(ids), ref)
    finally:
        m.close()
