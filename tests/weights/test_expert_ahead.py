"""Pre-gating read-ahead (weights.expert_ahead): layer i guesses layer i+1's experts and a
background thread reads the cold ones. The reference is the same placed load with the
read-ahead off (itself checked bit for bit against the resident load by
tests/memory/test_expert_placement.py): the logits must be equal bit for bit, prefill and
decode, at several budgets, and the expert calls served from RAM and from the file the same;
the guess's counters must add up; the thread must stop at close; a read that fails on the
thread must raise the error a read on the critical path raises."""

from __future__ import annotations

import re
import threading

import pytest
import torch

import slipstream
from slipstream.errors import BadArgument, BudgetTooSmall, GGUFError
from slipstream.model.llama import moe_router_input
from slipstream.model.moe import moe_ffn
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth
from slipstream.weights.expert_ahead import Pregate, wire
from slipstream.weights.expert_tiers import (AHEAD_THREAD, ExpertFile, ExpertSlice,
                                             TieredExperts)

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary
CTX = 64


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("ahead") / "q.gguf", "tiny", "Q8_0",
                       n_layers=3, arch="qwen3moe", from_floats=True, seed=3, std=0.15)


def _expert_bytes(path, n_experts: int = 16) -> int:
    """One expert's bytes of its three tensors (the tiny shape's 16 experts a layer)."""
    gf = GGUFFile(path)
    per = sum(gf.tensors[f"blk.0.ffn_{p}_exps.weight"].n_bytes for p in ("gate", "up", "down"))
    gf.close()
    return per // n_experts


def _placed(path, slots: int, stage: str, monkeypatch):
    """A load holding `slots` experts per layer (the budget the plan needs for them)."""
    monkeypatch.setenv("SLIPSTREAM_EXPERT_AHEAD", stage)
    with pytest.raises(BudgetTooSmall) as e:
        slipstream.plan(path, device="cpu", ctx=CTX, precision="exact", measure=False,
                        placement=slipstream.Placement(ram_budget=1))
    need = int(re.search(r"\(1 < (\d+) bytes", str(e.value)).group(1))
    budget = need + 3 * slots * _expert_bytes(path)
    m = slipstream.load(path, device="cpu", ctx=CTX, precision="exact",
                        placement=slipstream.Placement(ram_budget=budget))
    assert m.plan.expert_slots == [slots] * 3
    return m


def _ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(AHEAD_THREAD)]


def _run(path, slots, stage, decode, monkeypatch):
    m = _placed(path, slots, stage, monkeypatch)
    layers = m.engine.weights.layers
    hooks = [w.moe.ahead for w in layers]
    logits = m.logits(IDS[:12], one_at_a_time=decode)
    s = m.engine.layers.stats
    counts = dict(hits=s.expert_hits, misses=s.expert_misses, reads=s.expert_ahead_reads,
                  ahead_hits=s.expert_ahead_hits, ahead_bytes=s.expert_ahead_bytes,
                  bytes_read=s.expert_bytes_read)
    m.close()
    return logits, counts, hooks


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("slots", [pytest.param(1, marks=pytest.mark.slow), 8,
                                   pytest.param(15, marks=pytest.mark.slow)])
def test_read_ahead_gives_the_same_logits_and_calls(qwen_file, monkeypatch, decode, slots):
    ref, c0, hooks0 = _run(qwen_file, slots, "off", decode, monkeypatch)
    assert hooks0 == [None, None, None] and c0["reads"] == 0 and c0["ahead_hits"] == 0
    per = _expert_bytes(qwen_file)
    for stage in ("attention", "input"):
        got, c, hooks = _run(qwen_file, slots, stage, decode, monkeypatch)
        assert torch.equal(ref, got), (stage, (ref - got).abs().max())
        # layers 0 and 1 guess their next layer's; the last has none to guess
        assert [type(h) for h in hooks] == [Pregate, Pregate, type(None)]
        assert all(h.stage == stage for h in hooks[:2])
        # the same experts served from RAM and from the file: the guess changes no policy
        assert (c["hits"], c["misses"]) == (c0["hits"], c0["misses"]), stage
        assert c["misses"] > 0 and c["reads"] > 0
        # the guess's counters add up: a hit is a miss that was read ahead; the bytes read on
        # the critical path are the misses left's; the thread's, its reads'
        assert 0 <= c["ahead_hits"] <= min(c["misses"], c["reads"])
        if slots <= 8:  # (one cold expert a layer: a right guess is rare)
            assert c["ahead_hits"] > 0
        assert c["bytes_read"] == (c["misses"] - c["ahead_hits"]) * per
        assert c["ahead_bytes"] == c["reads"] * per
        assert c0["bytes_read"] == c0["misses"] * per
    assert not _ahead_threads()  # every model's close stopped its thread


def test_a_right_guess_reads_every_cold_expert_ahead(qwen_file, monkeypatch):
    """Layer 1's router on layer 1's own FFN input: the guess is the routing, so every
    miss is served by a read ahead, and nothing is wasted."""
    m = _placed(qwen_file, 4, "off", monkeypatch)
    cfg, w = m.engine.cfg, m.engine.weights.layers[1]
    bank = w.moe.experts
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(0))
    own = Pregate("attention", lambda t: moe_router_input(cfg, w, t), w.moe)
    own(x, "input")  # another stage: no guess
    assert not bank.pending
    own(x, "attention")
    guessed = set(bank.pending)
    assert guessed and not guessed & set(bank.held)
    s = m.engine.layers.stats
    before = (s.expert_misses, s.expert_ahead_hits)
    moe_ffn(moe_router_input(cfg, w, x), w.moe)
    assert not bank.pending  # the call's end drops what it did not take
    misses, hits = s.expert_misses - before[0], s.expert_ahead_hits - before[1]
    assert misses == hits == len(guessed)
    m.close()
    assert bank.file.closed and not _ahead_threads()


def test_the_thread_stops_at_close(qwen_file, monkeypatch):
    m = _placed(qwen_file, 4, "attention", monkeypatch)
    m.logits(IDS[:4], one_at_a_time=True)
    assert _ahead_threads()  # started by the first guess
    f = m.engine.weights.experts
    bank = m.engine.weights.layers[2].moe.experts
    m.close()
    assert not _ahead_threads() and f.closed
    with pytest.raises(GGUFError, match="closed"):
        bank.read_ahead([e for e in range(16) if e not in bank.held][:1])


def test_wire_refuses_an_unknown_stage_and_the_env_var_is_checked(qwen_file, monkeypatch):
    m = _placed(qwen_file, 4, "off", monkeypatch)
    with pytest.raises(BadArgument, match="'later'"):
        wire(m.engine.cfg, m.engine.weights.layers, "later")
    assert wire(m.engine.cfg, m.engine.weights.layers, "input") == 2
    assert wire(m.engine.cfg, m.engine.weights.layers, "off") == 0
    assert all(w.moe.ahead is None for w in m.engine.weights.layers)
    m.close()
    with pytest.raises(BadArgument, match="SLIPSTREAM_EXPERT_AHEAD='on'"):
        _placed(qwen_file, 4, "on", monkeypatch)


class _Bytes:
    """A `make` that keeps the bytes: the bank's 'linears' are the raw bytes read."""

    def __call__(self, e, raws):
        return raws[0], None


def test_a_failed_read_ahead_raises_the_critical_paths_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(100)))
    f = ExpertFile(path)
    sl = ExpertSlice(offset=20, expert_bytes=30, rows=3, row_bytes=10)
    bank = TieredExperts(4, 0, f, [sl], _Bytes(), {})
    bank.read_ahead([1, 2, 3])
    assert bank._pair(1, 1)[0].flatten().tolist() == list(range(50, 80))
    # expert 2 runs past the file's end: the thread's error, raised where the layer takes it
    with pytest.raises(GGUFError, match="expert 2's bytes end past the file: read 20 of 30"):
        bank._pair(2, 1)
    # the same message as a read on the critical path
    with pytest.raises(GGUFError, match="expert 2's bytes end past the file: read 20 of 30"):
        f.read(sl, 2)
    bank.drop_pending()  # a wrong guess's error stays unseen: expert 3 is never called
    assert not bank.pending
    assert f.stats.expert_ahead_reads == 1 and f.stats.expert_ahead_hits == 1
    assert f.stats.expert_misses == 2
    f.close()
    assert not _ahead_threads()


def test_generation_stats_carry_the_read_ahead(qwen_file, monkeypatch):
    m = _placed(qwen_file, 4, "attention", monkeypatch)
    gen = m.generate(IDS[:6], max_tokens=6, temperature=0.0)
    list(gen)
    x = gen.stats.extra
    assert x["experts_misses"] > 0 and x["experts_ahead_reads"] > 0
    assert x["experts_ahead_rate"] == x["experts_ahead_hits"] / x["experts_misses"]
    s = m.engine.layers.stats
    assert s.expert_ahead_rate == s.expert_ahead_hits / s.expert_misses
    m.close()


def test_stats_table_shows_the_guess():
    """--stats' table (cli.render): the read-ahead's line only where something was read
    ahead, its figures the counters'."""
    from slipstream.cli.render import breakdown_table
    from slipstream.memory.protocol import StoreStats
    from slipstream.runtime.generate import GenerationStats

    gen = GenerationStats(prompt_tokens=4, generated_tokens=8, prefill_s=0.1, decode_s=0.5)
    s = StoreStats(expert_hits=30, expert_misses=10, expert_bytes_read=4_000_000)
    assert s.expert_ahead_rate is None
    assert "read ahead" not in breakdown_table(gen, s, "cpu").caption
    s.expert_ahead_reads, s.expert_ahead_hits, s.expert_ahead_bytes = 9, 4, 9_000_000
    assert s.expert_ahead_rate == 0.4
    caption = breakdown_table(gen, s, "cpu").caption
    assert "read ahead: 4 of 10 cold experts guessed (40.0%), 9 read (9.0 MB), 5 wasted" \
        in caption, caption
