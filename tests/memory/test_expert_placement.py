"""A mixture of experts placed expert by expert on the CPU (memory.expert_plan,
weights.expert_tiers): at a RAM budget below the whole model, the dense part stays resident,
some experts per layer in RAM, the rest read from the GGUF file when a token routes to them.

The reference is the resident load of the same file, whose experts tests/model/test_moe.py
checks against gguf-py's dequantize, transformers and llama.cpp: the placed load must give
the same logits bit for bit, at every position, prefill and decode. A negative control (cold
experts read from the next expert's bytes) must fail that comparison. The cache's policy is
checked as a property (held experts are always a most-used set), and the skew of
`synth --expert-skew` files must show in the hit rate."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import slipstream
from slipstream.errors import BadArgument, BudgetTooSmall, GGUFError
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth
from slipstream.weights.expert_tiers import (ExpertCounts, ExpertFile, ExpertSlice,
                                             TieredExperts)

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary
CTX = 64


def _write(d, arch: str, n_layers: int = 2, skew: float = 0.0, seed: int = 3,
           std: float = 0.15, fused: bool = False):
    return write_synth(d / f"{arch}-{skew}-{fused}.gguf", "tiny", "Q8_0", n_layers=n_layers,
                       arch=arch, from_floats=True, seed=seed, std=std, expert_skew=skew,
                       fused_experts=fused)


def _plan(path, budget, precision="exact"):
    return slipstream.plan(path, device="cpu", ctx=CTX, precision=precision, measure=False,
                           placement=slipstream.Placement(ram_budget=budget))


def _load(path, budget=None, precision="exact"):
    placement = slipstream.Placement(ram_budget=budget) if budget is not None else None
    return slipstream.load(path, device="cpu", ctx=CTX, precision=precision,
                           placement=placement)


def dense_need(path, precision="exact") -> int:
    """The bytes the plan needs before any expert (from BudgetTooSmall at a 1-byte budget,
    which names it)."""
    with pytest.raises(BudgetTooSmall) as e:
        _plan(path, 1, precision)
    m = re.search(r"\(1 < (\d+) bytes", str(e.value))
    assert m, str(e.value)
    return int(m.group(1))


def half_budget(path, precision="exact") -> int:
    """A budget holding the dense part and half of every layer's experts."""
    need = dense_need(path, precision)
    plan = _plan(path, need, precision)
    return need + len(plan.tiers) * (plan.n_experts // 2) * plan.expert_bytes


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("qwen3moe"), "qwen3moe")


# -- the plan ---------------------------------------------------------------------------------

def test_plan_holds_the_dense_part_then_whole_experts(qwen_file):
    need = dense_need(qwen_file)
    gf = GGUFFile(qwen_file)
    dense_tensors = sum(t.n_bytes for n, t in gf.tensors.items() if "_exps" not in n)
    whole = _plan(qwen_file, None)
    gf.close()
    assert whole.expert_slots is None  # enough RAM: every expert resident, as before
    # the dense part counts at least the non-expert tensors' file bytes, and is less than the
    # whole model's plan
    assert dense_tensors < need < sum(whole.resident_bytes_per_layer) + whole.fixed_bytes
    # a budget of exactly the whole model's bytes, short of the plain plan's staging buffers:
    # experts placed, never a layer streamed (which a mixture of experts cannot)
    edge = _plan(qwen_file, sum(whole.resident_bytes_per_layer) + whole.fixed_bytes)
    assert not edge.streamed_layers and edge.expert_slots is not None
    plan = _plan(qwen_file, need)
    assert plan.expert_slots == [0, 0] and plan.tiers == ["ram", "ram"]
    assert not plan.streamed_layers
    e = plan.expert_bytes
    # one expert more than 3 per layer: the first layer takes it
    assert _plan(qwen_file, need + 7 * e).expert_slots == [4, 3]
    assert _plan(qwen_file, need + 8 * e - 1).expert_slots == [4, 3]
    assert _plan(qwen_file, need + 8 * e).expert_slots == [4, 4]
    # below the dense part: BudgetTooSmall naming the budget and the need
    with pytest.raises(BudgetTooSmall, match=rf"dense part.*\({need - 1} < {need} bytes"):
        _plan(qwen_file, need - 1)


def test_plan_table_shows_experts_per_layer(tmp_path):
    path = _write(tmp_path, "mixtral", n_layers=5)
    need = dense_need(path)
    plan = _plan(path, need + 12 * _plan(path, need).expert_bytes)  # 2 per layer, 2 more
    assert plan.expert_slots == [3, 3, 2, 2, 2]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan.table())
    text = console.export_text()
    assert "0-1: 3 of 8 in RAM, 5 on disk" in text
    assert "2-4: 2 of 8 in RAM, 6 on disk" in text


def test_plan_leaves_a_dense_layer_out(tmp_path):
    """GLM-4.5's first layer has a dense FFN: no expert slots there, the others share the
    budget's experts, and the table lists only the layers with experts."""
    path = _write(tmp_path, "glm4moe", n_layers=3)
    need = dense_need(path)
    plan = _plan(path, need + 5 * _plan(path, need).expert_bytes)
    assert plan.expert_slots == [0, 3, 2] and plan.expert_layers == (1, 2)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan.table())
    text = console.export_text()
    assert "1: 3 of 16 in RAM" in text and "2: 2 of 16 in RAM" in text
    assert "0: 0 of 16" not in text


# -- the same logits as the resident load --------------------------------------------------------

def _compare(path, precision, decode: bool, ids=IDS):
    budget = half_budget(path, precision)
    ref = _load(path, precision=precision)
    placed = _load(path, budget, precision)
    assert ref.plan.expert_slots is None
    layers = placed.engine.weights.layers
    # (the layers with experts: GLM-4.5's first layer is dense, and plans none)
    slots = [s for s, w in zip(placed.plan.expert_slots, layers) if w.moe is not None]
    assert slots and max(slots) < placed.plan.n_experts
    assert all(s == 0 for s, w in zip(placed.plan.expert_slots, layers) if w.moe is None)
    banks = [layer.moe.experts for layer in layers if layer.moe is not None]
    # the load builds only the planned experts of each layer
    assert [len(b.held) for b in banks] == [b.slots for b in banks] == slots
    a = ref.logits(ids, one_at_a_time=decode)
    b = placed.logits(ids, one_at_a_time=decode)
    assert [len(b.held) for b in banks] == slots  # bounded by the plan as it runs
    stats = placed.engine.layers.stats
    experts = placed.engine.weights.experts
    ref.close()
    placed.close()
    assert experts.closed  # the model's close gives its descriptor back
    return a, b, stats


def test_placed_experts_give_the_resident_logits(qwen_file):
    a, b, stats = _compare(qwen_file, "exact", decode=False, ids=IDS[:8])
    assert torch.equal(a, b)
    # experts came from disk, and the counters say so
    assert stats.expert_misses > 0 and stats.expert_hits > 0 and stats.expert_read_s > 0
    gf = GGUFFile(qwen_file)
    per = sum(gf.tensors[f"blk.0.ffn_{p}_exps.weight"].n_bytes for p in ("gate", "up", "down"))
    gf.close()
    assert stats.expert_bytes_read == stats.expert_misses * per // 16


@pytest.mark.slow
def test_negative_control_a_shifted_read_changes_the_logits(qwen_file, monkeypatch):
    """Cold experts read from the next expert's bytes: the comparison above must fail."""
    real = ExpertSlice.of

    def shifted(self, e):
        return real(self, (e + 1) % 16)

    monkeypatch.setattr(ExpertSlice, "of", shifted)
    a, b, _ = _compare(qwen_file, "exact", decode=False, ids=IDS[:8])
    assert not torch.allclose(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt-oss", "glm4moe", "deepseek2",
                                  "qwen35moe", "gemma4-moe"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_placed_experts_bit_identical(tmp_path_factory, arch, precision, decode):
    path = _write(tmp_path_factory.mktemp(arch), arch, n_layers=3)
    a, b, stats = _compare(path, precision, decode)
    assert torch.equal(a, b), (a - b).abs().max()
    assert stats.expert_misses > 0


@pytest.mark.parametrize("packed_prefill", ["1", "0"])
def test_experts_read_from_the_file_mix_many_rows_as_resident_ones(qwen_file, monkeypatch,
                                                                   packed_prefill):
    """A prefill that routes 300 rows to one expert: the bank whose experts are read from the
    file (expert by expert, weights.cpu.expert_decode.native_expert_ffn) gives the resident
    bank's one native call's bits (weights.cpu.expert_rows), with packed prefill on or off:
    an expert's rows take its packed kernels at any count in both."""
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", packed_prefill)
    ref = _load(qwen_file, precision="fast")
    placed = _load(qwen_file, half_budget(qwen_file, "fast"), "fast")
    resident = ref.engine.weights.layers[0].moe.experts
    tiered = placed.engine.weights.layers[0].moe.experts
    assert isinstance(tiered, TieredExperts) and tiered.slots < tiered.n_experts
    g = torch.Generator().manual_seed(4)
    rows = 300
    h = torch.randn(rows, ref.engine.cfg.hidden, generator=g)
    cold = tiered.n_experts - 1  # not held at the load: read from the file
    assert cold not in tiered.held
    ids = torch.stack([torch.full((rows,), cold),
                       torch.randint(0, cold, (rows,), generator=g)], dim=1)
    weights = torch.rand(rows, 2, generator=g)
    assert torch.equal(resident.mix(h, ids, weights), tiered.mix(h, ids, weights))
    ref.close()
    placed.close()


def test_placed_fused_experts_give_the_resident_logits(tmp_path):
    """Gate and up stored as one tensor (ffn_gate_up_exps): a cold expert's gate and up are
    read as the two halves of its block, as many bytes as the split file's."""
    path = _write(tmp_path, "qwen3moe", fused=True)
    a, b, stats = _compare(path, "exact", decode=False, ids=IDS[:8])
    assert torch.equal(a, b)
    assert stats.expert_misses > 0
    gf = GGUFFile(path)
    per = sum(gf.tensors[f"blk.0.ffn_{p}_exps.weight"].n_bytes for p in ("gate_up", "down"))
    gf.close()
    assert stats.expert_bytes_read == stats.expert_misses * per // 16


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek2", "gemma4-moe"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_placed_fused_experts_bit_identical(tmp_path_factory, arch, decode):
    path = _write(tmp_path_factory.mktemp(arch), arch, n_layers=3, fused=True)
    a, b, stats = _compare(path, "fast", decode)
    assert torch.equal(a, b), (a - b).abs().max()
    assert stats.expert_misses > 0


def test_a_file_cut_short_fails_naming_the_expert(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(100)))
    f = ExpertFile(path)
    sl = ExpertSlice(offset=20, expert_bytes=30, rows=3, row_bytes=10)
    assert f.read(sl, 1).flatten().tolist() == list(range(50, 80))  # expert 1: bytes 50-79
    assert f.stats.expert_bytes_read == 30
    with pytest.raises(GGUFError, match="expert 2's bytes end past the file: read 20 of 30"):
        f.read(sl, 2)
    with pytest.raises(GGUFError, match="expert 3's bytes end past the file: read 0 of 30"):
        f.read(sl, 3)
    f.close()
    assert f.closed


# -- the cache's policy and the hit rate ----------------------------------------------------------

class _FakeFile:
    """An ExpertFile that reads nothing: counts only."""

    def __init__(self):
        self.stats = ExpertCounts()

    def read(self, sl, e):
        self.stats.expert_bytes_read += sl.expert_bytes
        return torch.zeros(sl.rows, sl.row_bytes, dtype=torch.uint8)

    def count(self, hits=0, misses=0, bytes_read=0):
        self.stats.expert_hits += hits
        self.stats.expert_misses += misses


class _Const:
    """A linear pair whose FFN output is its expert's number."""

    def __init__(self, e):
        self.e = e

    def __call__(self, h):
        return h

    def glu_matmul(self, x, act="silu"):
        return torch.full_like(x, float(self.e))


def _bank(n, slots, decay_rows=1 << 30):
    made = []

    def make(e, raws):
        made.append(e)
        return _Const(e), _Const(e)

    held = {e: make(e, []) for e in range(slots)}
    made.clear()
    sl = [ExpertSlice(0, 10, 2, 5)]
    return TieredExperts(n, slots, _FakeFile(), sl, make, held, decay_rows), made


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.data())
def test_held_experts_are_always_a_most_used_set(n, data):
    slots = data.draw(st.integers(0, n))
    calls = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 3)),
                               max_size=80))
    # counts halved now and then, or never: the order they keep is what the slots follow
    bank, made = _bank(n, slots, data.draw(st.sampled_from([7, 20, 1 << 30])))
    h = torch.ones(1, 4)
    for e, rows in calls:
        out = bank.ffn(e, h.expand(rows, 4))
        assert torch.equal(out, torch.full((rows, 4), float(e)))  # the right expert ran
        assert len(bank.held) <= slots
        # no expert outside RAM has been used more than one inside
        inside = min((bank.uses[x] for x in bank.held), default=None)
        if inside is not None and len(bank.held) == slots:
            assert all(bank.uses[x] <= inside for x in range(n) if x not in bank.held)
    s = bank.file.stats
    assert s.expert_hits + s.expert_misses == len(calls)
    assert s.expert_misses == len(made) and s.expert_bytes_read == 10 * len(made)


def test_a_cold_expert_takes_the_least_used_slot():
    bank, _ = _bank(4, 2)
    h = torch.ones(1, 4)
    bank.ffn(0, h)
    bank.ffn(2, h)  # 2 used once, 1 never: 2 takes 1's slot
    assert set(bank.held) == {0, 2}
    bank.ffn(3, h)  # used as often as the least used held one (0 and 2: once): dropped
    assert set(bank.held) == {0, 2}
    bank.ffn(3, h)  # now more: takes a slot
    assert 3 in bank.held and len(bank.held) == 2
    # popularity moves: with counts halved every 8 rows, a newly popular expert takes the slot
    # within 12 calls (the old favourite's count stays about 7), where never halved counts
    # keep the favourite of the first 40 calls
    for decay, expect in ((8, True), (1 << 30, False)):
        bank, _ = _bank(4, 1, decay)
        for _ in range(40):
            bank.ffn(0, h)
        for _ in range(12):
            bank.ffn(3, h)
        assert (3 in bank.held) is expect
    with pytest.raises(BadArgument, match="slots=5"):
        TieredExperts(4, 5, bank.file, bank.slices, bank.make, {})


def _hit_rate(path, budget) -> float:
    m = _load(path, budget, "exact")
    m.logits(IDS, one_at_a_time=True)
    rate = m.engine.layers.stats.expert_hit_rate
    m.close()
    return rate


@pytest.mark.slow
def test_skewed_routing_hits_more_than_uniform(tmp_path):
    """At the same budget (the two files have the same shapes), a Zipf-like popularity of
    experts leaves more of the calls to the experts the bank has moved into RAM. Weights of
    synth's default spread (std 0.02): at 0.15 the random part of the router's logits drowns
    the skew (measured: hit rates 0.37 and 0.37 at skew 0 and 2, against 0.47 and 0.68)."""
    uniform = _write(tmp_path, "qwen3moe", skew=0.0, std=0.02)
    skewed = _write(tmp_path, "qwen3moe", skew=2.0, std=0.02)
    need = dense_need(uniform)
    assert dense_need(skewed) == need
    budget = need + 2 * 4 * _plan(uniform, need).expert_bytes  # 4 of 16 per layer
    u, s = _hit_rate(uniform, budget), _hit_rate(skewed, budget)
    assert s > u + 0.1, (u, s)


# -- the CLI --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_info_plan_and_run_stats(qwen_file, capsys, monkeypatch):
    from slipstream import cli

    monkeypatch.setenv("COLUMNS", "200")  # rich wraps a table's cells at 80 columns otherwise
    budget = half_budget(qwen_file, "fast")
    assert cli.main(["info", "-m", str(qwen_file), "--plan", "--ram-budget", str(budget),
                     "--device", "cpu", "--ctx", str(CTX)]) == 0
    out = capsys.readouterr().out
    assert "8 of 16 in RAM, 8 on disk" in out
    assert cli.main(["run", "-m", str(qwen_file), "--ram-budget", str(budget), "--device",
                     "cpu", "--ctx", str(CTX), "-n", "8", "--raw", "--stats", "--temp", "0",
                     "-p", "hello"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"hit\s+rate\s+\d+\.\d%", err), err


@pytest.mark.slow
def test_the_cpu_probe_runs_a_moe_layer(qwen_file):
    """`info --plan` and `load` probe a layer's decode rate: a mixture of experts has no packed
    layer image, so its layer is built as a resident one and runs its experts."""
    import math

    from slipstream.memory.probes import cpu_decode_rates
    from slipstream.memory.setup import head_decode_bytes, layer_resident_bytes
    from slipstream.modelfile.config import ModelConfig
    from slipstream.precision import Precision

    gf = GGUFFile(qwen_file)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    fast = Precision.of("fast", torch.device("cpu"))
    rates = cpu_decode_rates(gf, cfg, fast, 1, layer_resident_bytes(gf, 1, fast),
                             head_decode_bytes(gf, fast), time_budget_s=0.05, max_reps=2)
    gf.close()
    assert set(rates) == {"rebuild", "compute", "gemv"}
    assert all(math.isfinite(v) and v > 0 for v in rates.values())


def test_the_load_checks_leave_placed_experts_in_the_file(qwen_file, monkeypatch):
    """A placed load does not read every expert to check its scales (the whole model, at
    every load); a resident one does."""
    from slipstream.modelfile.config import ModelConfig
    from slipstream.weights import checks

    seen: list[list[str]] = []
    monkeypatch.setattr(checks, "value_findings",
                        lambda gf, names, kinds, first_only: seen.append(names) or [])
    # no record of earlier loads (weights.checked): both calls read all they check
    monkeypatch.setattr(checks.checked, "passed", lambda model: set())
    gf = GGUFFile(qwen_file)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    checks.check_values(gf, cfg, None, True, True)
    checks.check_values(gf, cfg, None, True, True, experts=False)
    gf.close()
    resident, placed = seen
    assert {n for n in resident if "_exps" in n} == {
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")}
    assert not any("_exps" in n for n in placed)
    assert set(placed) == {n for n in resident if "_exps" not in n}
