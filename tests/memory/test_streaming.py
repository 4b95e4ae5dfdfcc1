"""Streaming layers from disk on CPU gives bit-identical results to the resident run, under
injected reader delays too, and every failure ends in a clear error instead of a hang."""

from __future__ import annotations

import errno
import random
import shutil
import time

import pytest
import torch

import slipstream
from slipstream.errors import BudgetTooSmall
from slipstream.memory import parse_size
from slipstream.memory.disk import DiskReadError
from slipstream.runtime.build import injected_stream_delay
from slipstream.synth import write_synth

from helpers import cpu_budget

PROMPT = [5, 77, 300, 12, 901, 44, 7, 8]
# Streamed and resident layers compute alike at either precision. Here both sides load at
# "exact", where every pass rebuilds each streamed layer from its GGUF bytes (dense float32);
# at "fast" streamed layers decode from packed images (tests/memory/test_cpu_stream_packed.py).
EXACT = "exact"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return write_synth(d / "tiny.gguf", "tiny", "Q4_K", n_layers=6, from_floats=True, std=0.08,
                       seed=11)


def greedy(model, n=12):
    return [e.id for e in model.generate(PROMPT, max_tokens=n, temperature=0)]


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("512 MB") == 512 * 10**6
    assert parse_size(1234) == 1234 and parse_size(None) is None


@pytest.mark.slow
@pytest.mark.parametrize("io", ["direct", "buffered", "mmap"])
def test_streamed_equals_resident(tiny, io):
    resident = slipstream.load(tiny, device="cpu", ctx=64, precision=EXACT)
    budget = resident.plan.fixed_bytes + 2 * max(resident.plan.file_bytes_per_layer) + \
        2 * resident.plan.resident_bytes_per_layer[0] + 1
    streamed = slipstream.load(tiny, device="cpu", ctx=64, precision=EXACT,
                               placement=slipstream.Placement(ram_budget=budget, io=io))
    assert streamed.plan.tiers.count("ram") == 2 and streamed.plan.tiers.count("disk") == 4
    assert torch.equal(resident.logits(PROMPT), streamed.logits(PROMPT))
    assert greedy(resident) == greedy(streamed)
    assert streamed.engine.layers.stats.layers_streamed > 0


@pytest.mark.slow
def test_streamed_equals_resident_with_random_reader_delays(tiny):
    resident = slipstream.load(tiny, device="cpu", ctx=64, precision=EXACT)
    rng = random.Random(1)
    budget = resident.plan.fixed_bytes + 2 * max(resident.plan.file_bytes_per_layer) + 1
    with injected_stream_delay(lambda: time.sleep(rng.random() / 50)):
        streamed = slipstream.load(tiny, device="cpu", ctx=64, precision=EXACT,
                                   placement=slipstream.Placement(ram_budget=budget))
    assert streamed.plan.tiers == ["disk"] * 6
    assert greedy(resident, 16) == greedy(streamed, 16)


@pytest.mark.slow
def test_real_model_streamed_equals_resident(smollm_path):
    resident = slipstream.load(smollm_path, device="cpu", ctx=128, precision=EXACT)
    streamed = slipstream.load(smollm_path, device="cpu", ctx=128, precision=EXACT,
                               placement=slipstream.Placement(ram_budget="150MiB"))
    assert "disk" in streamed.plan.tiers and "ram" in streamed.plan.tiers
    ids = resident.tokenize("Streaming must not change a single bit:")
    assert torch.equal(resident.logits(ids), streamed.logits(ids))
    a = [e.id for e in resident.generate(ids, max_tokens=6, temperature=0)]
    b = [e.id for e in streamed.generate(ids, max_tokens=6, temperature=0)]
    assert a == b


def test_budget_too_small_names_the_minimum(tiny):
    with pytest.raises(BudgetTooSmall, match=r"cannot run this model on cpu: it needs at least "
                                             r"[0-9.]+ [KMG]iB"):
        slipstream.load(tiny, device="cpu", ctx=64,
                        placement=slipstream.Placement(ram_budget="1KiB"))


def all_streamed(path, precision: str) -> int:
    """A RAM budget that streams every layer of `path` from disk."""
    return cpu_budget(path, precision=precision)


@pytest.mark.slow
def test_truncated_file_mid_run_is_a_clear_error(tiny, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny, path)
    # at "exact" every pass reads the GGUF file (at "fast" decode reads the packed images,
    # whose truncation test_cpu_stream_packed.py checks)
    model = slipstream.load(path, device="cpu", ctx=64, precision=EXACT,
                            placement=slipstream.Placement(ram_budget=all_streamed(path, EXACT),
                                                           io="buffered"))
    assert model.plan.tiers == ["disk"] * 6
    greedy(model, 2)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(DiskReadError, match="truncated or replaced while running"):
        greedy(model, 2)


@pytest.mark.slow
def test_deleted_file_keeps_working_through_the_open_descriptor(tiny, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny, path)
    resident = slipstream.load(tiny, device="cpu", ctx=64, precision=EXACT)
    budget = resident.plan.fixed_bytes + 2 * max(resident.plan.file_bytes_per_layer) + 1
    model = slipstream.load(path, device="cpu", ctx=64, precision=EXACT,
                            placement=slipstream.Placement(ram_budget=budget))
    assert model.plan.disk_layers
    path.unlink()  # POSIX: the open file lives on until closed; no hang, no wrong bytes
    assert greedy(model, 6) == greedy(resident, 6)


@pytest.mark.slow
def test_disk_read_error_is_a_clear_error(tiny):
    def fail():
        raise OSError(errno.EIO, "Input/output error")

    budget = all_streamed(tiny, "fast")
    with injected_stream_delay(fail):
        model = slipstream.load(tiny, device="cpu", ctx=64,
                                placement=slipstream.Placement(ram_budget=budget))
    with pytest.raises(DiskReadError, match="Input/output error"):
        greedy(model, 2)
