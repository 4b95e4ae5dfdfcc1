"""A split prefill's streaming (weights.expert_stream), its CPU-side pieces: the rule that
chooses between streaming and the CPU, and the GGUF bytes of a RAM-held expert that it copies
up (checked against the file's own bytes of that expert). The streamed pass itself runs in
tests/gpu/test_expert_split.py (Triton's interpreter) and tests/gpu/test_expert_split_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

import slipstream
from slipstream.errors import BadArgument, BudgetTooSmall
from slipstream.synth import write_synth
from slipstream.weights.expert_stream import StreamRates, held_bytes
from slipstream.weights.linear import DenseLinear

CTX = 64


def test_stream_where_the_pairs_outside_vram_outrun_the_copies():
    """The CPU reads an expert's bytes once per row, a copy once per pass: at 75 GB/s of CPU
    and 25 of copies a pass streams above 3 rows a streamed expert, on either side of it."""
    r = StreamRates(h2d_gbps=25.0, cpu_gbps=75.0)
    assert r.rows_per_expert == 3.0
    assert not r.streams(pairs=30, experts=10) and r.streams(pairs=31, experts=10)
    assert not r.streams(pairs=8, experts=8)  # a decode token's k experts, one row each
    assert not r.streams(pairs=0, experts=0)
    # a faster link streams sooner
    assert StreamRates(h2d_gbps=50.0, cpu_gbps=75.0).streams(pairs=16, experts=10)
    with pytest.raises(BadArgument, match="h2d_gbps=0"):
        StreamRates(h2d_gbps=0, cpu_gbps=1.0)
    with pytest.raises(BadArgument, match="cpu_gbps=-1"):
        StreamRates(h2d_gbps=1.0, cpu_gbps=-1)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_held_bytes_are_the_files_bytes_of_the_expert(tmp_path, precision):
    """A CPU load holding 2 experts a layer in RAM (weights.expert_tiers): each held expert's
    bytes, through its lazy linears (inside the packed decode copies at "fast"), are its
    gate, up and down bytes in the file; an expert not held, or held without its bytes,
    gives None; a cold expert read into a buffer is `read`'s bytes."""
    path = write_synth(tmp_path / "q.gguf", "tiny", "Q8_0", n_layers=1, arch="qwen3moe")
    with pytest.raises(BudgetTooSmall) as e:
        slipstream.plan(path, device="cpu", ctx=CTX, precision=precision, measure=False,
                        placement=slipstream.Placement(ram_budget=1))
    need = int(re.search(r"\(1 < (\d+) bytes", str(e.value)).group(1))
    with slipstream.load(path, device="cpu", ctx=CTX, precision=precision,
                         placement=slipstream.Placement(ram_budget=need + (1 << 20))) as m:
        bank = m.engine.weights.layers[0].moe.experts
        assert len(bank.held) >= 2, "the budget holds experts in RAM"
        for e, pair in bank.held.items():
            got = held_bytes(pair)
            want = [bank.file.read(sl, e) for sl in bank.slices]
            assert got is not None and len(got) == 3
            assert all(torch.equal(g, w) for g, w in zip(got, want)), e
        # an expert not held, read straight into a buffer as `read` gives it
        cold = next(e for e in range(bank.n_experts) if e not in bank.held)
        for sl in bank.slices:
            out = torch.empty(sl.rows * sl.row_bytes, dtype=torch.uint8)
            bank.file.read_into(sl, cold, out)
            assert torch.equal(out.view(sl.rows, sl.row_bytes), bank.file.read(sl, cold))
        with pytest.raises(BadArgument, match=f"{sl.rows * sl.row_bytes - 1} torch.uint8"):
            bank.file.read_into(sl, cold, out[1:])
        assert held_bytes(None) is None
        dense = DenseLinear(torch.zeros(4, 4))
        assert held_bytes((dense, dense)) is None
