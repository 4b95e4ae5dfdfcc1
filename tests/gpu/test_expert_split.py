"""A mixture of experts' layer split between VRAM slots and the CPU (weights.split_experts,
built by weights.split_build) against the all-VRAM bank of the same layer
(weights.routed_experts, which tests/gpu/test_moe_bank.py checks against the CPU engine):

- every expert in a slot: the same bits as the all-VRAM bank (the same routed kernels over
  the same planes, slot numbers for ids);
- some experts on the CPU: the GPU's part is the all-VRAM bank's sum over the slots' pairs
  bit for bit, and the CPU's part its own bank's one-token sum (weights.expert_tiers: native
  q4vnni/q8vnni at "fast", dense float32 at "exact"), added once; against the all-VRAM bank
  within the precision's bound (the CPU's kernels round otherwise: "fast" rounds the
  activations to int8 on both sides, by blocks of their own);
- after swaps (online placement): the same composition bit for bit with the map as it is
  then, i.e. every swapped slot holds exactly its expert's planes and bias.

SLIPSTREAM_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs them in Triton's interpreter; the
hand-off to the CPU (hybrid.host_io.HostIO) computes at once on a CPU device, and through its
worker thread and the wait-and-add kernel on CUDA.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from slipstream.hybrid.host_io import HostIO  # noqa: E402
from slipstream.model.moe import moe_ffn, route  # noqa: E402
from slipstream.modelfile.config import ModelConfig  # noqa: E402
from slipstream.modelfile.gguf_file import GGUFFile  # noqa: E402
from slipstream.precision import Precision  # noqa: E402
from slipstream.synth import SynthShape, write_synth  # noqa: E402
from slipstream.weights.experts import build_experts  # noqa: E402
from slipstream.weights.linear import Workspace  # noqa: E402
from slipstream.weights.loader import LayerBuilder, TensorSource  # noqa: E402
from slipstream.weights.split_build import SplitPlacement  # noqa: E402
from slipstream.weights.split_experts import SplitExperts  # noqa: E402

pytestmark = pytest.mark.gpu
INTERPRETABLE = True  # runs in Triton's interpreter too (tests/conftest.py)

DEVICE = torch.device(os.environ.get("SLIPSTREAM_TEST_DEVICE", "cuda"))
CPU = torch.device("cpu")
INTERPRET = DEVICE.type == "cpu"
TOL = {"exact": 1e-5, "fast": 4e-2}
TOKENS = 3 if INTERPRET else 8  # decode tokens per check (the interpreter runs in Python)
# the interpreter's model: 64 wide, 6 experts of 64, 2 a token (block-32 formats only)
MICRO = SynthShape(hidden=64, ffn=128, n_layers=1, n_heads=2, n_kv_heads=1, vocab=256,
                   context=256, rope_base=10000.0, n_experts=6, n_experts_used=2,
                   expert_ffn=64)
CASES = ([("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4")] if INTERPRET
         else [("qwen3moe", "Q4_K"), ("gpt-oss", "MXFP4")])


@pytest.fixture(autouse=True)
def _slot_writes_in_parts(monkeypatch):
    """Slots written 48 rows at a time (the load, every swap, a prefill's staging), so that
    the small model's projections (64 and 128 rows) are written in parts, the last one short:
    the planes must be the whole expert's all the same."""
    import slipstream.weights.expert_stream as expert_stream
    import slipstream.weights.split_experts as split_experts

    monkeypatch.setattr(split_experts, "SLOT_WRITE_ROWS", 48)
    # a prefill's staging slots too (weights.expert_stream: by weights; 64 columns here)
    monkeypatch.setattr(expert_stream, "STAGING_WRITE_ELEMENTS", 48 * 64)


@pytest.fixture(autouse=True)
def _stall_dumps(monkeypatch):
    """A CPU share still running after 10 s on the worker (it takes milliseconds; the GPU's
    wait gives up at 60) has every thread's stack in the test's captured stderr."""
    monkeypatch.setenv("SLIPSTREAM_STALL_DUMP_S", "10")


def _builder(cfg: ModelConfig, precision: str, split: SplitPlacement | None = None,
             path=None) -> LayerBuilder:
    """The loader's GPU builder (on the interpreter's CPU device, its quantized build forced,
    as tests/gpu/test_moe_bank.py does), with the split's spec (over the file at `path`)
    where given, as load_weights makes it."""
    spec = None
    if split is not None:
        cpu_builder = LayerBuilder(cfg, CPU, Precision.of(precision, CPU))
        spec = split.spec(path, DEVICE, cfg.hidden, cpu_builder, cfg.n_layers)
    if DEVICE.type == "cuda":
        return LayerBuilder(cfg, DEVICE, Precision.of(precision, DEVICE), expert_split=spec)
    fast = precision == "fast"
    p = dataclasses.replace(Precision.of(precision, CPU), int8_activations=fast,
                            fuse_scales=fast, cpu_packed_decode=False,
                            float32_products=not fast)
    ws = Workspace(DEVICE, int8_activations=fast, float32_products=not fast)
    b = LayerBuilder(cfg, DEVICE, p, workspace=ws, expert_split=spec)
    b.quantized = True
    b.fuse_scales = fast
    return b


def _layers(tmp_path, arch: str, quant: str, precision: str, vram: int | None, ram: int):
    """(cfg, all-VRAM layer, split layer) of a one-layer synth file; vram None: every
    expert in a slot."""
    path = write_synth(tmp_path / f"{arch}.gguf", MICRO if INTERPRET else "tiny", quant,
                       n_layers=1, arch=arch)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    src = TensorSource(gf)
    whole = build_experts(_builder(cfg, precision, None), src, "blk.0")
    vram = cfg.n_experts if vram is None else vram
    placement = SplitPlacement([vram], [ram], lambda dev, hidden: HostIO(dev, hidden, 1))
    split = build_experts(_builder(cfg, precision, placement, path), src, "blk.0")
    assert isinstance(split.experts, SplitExperts)
    return cfg, whole, split


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def _share_landed(bank: SplitExperts) -> None:
    """On CUDA: wait until the token's CPU share has been added (the stream's wait for the
    worker), and raise if that wait gave up (its timeout: a stale share added, which no
    comparison should be left to find). Then the composition below runs the CPU bank on this
    thread with the worker idle, never beside it on the same experts, and launches nothing
    while a wait for the worker is in flight."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
        bank.runtime.io.check_waits()


def _composed(whole, split, h, ids, w) -> torch.Tensor:
    """The split's decode as its parts define it: the all-VRAM bank over the pairs the map
    puts in VRAM (the others at weight 0), plus the CPU bank's own sum of the rest."""
    bank: SplitExperts = split.experts
    flat = ids[0].tolist()
    in_vram = torch.tensor([[bank.map.in_vram(e) for e in flat]], device=w.device)
    gpu = whole.experts.mix(h, ids, torch.where(in_vram, w.float(), 0.0))
    cpu = sorted((e, j) for j, e in enumerate(flat) if not bank.map.in_vram(e))
    if not cpu:
        return gpu
    host_w = w.float().cpu()[0][[j for _, j in cpu]].contiguous()
    y = bank.cpu.ffn_one([e for e, _ in cpu], host_w, h.float().cpu().to(bank.cpu_act_dtype))
    return gpu + y.float().to(gpu.device).to(gpu.dtype)


def _tokens(cfg: ModelConfig, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, cfg.hidden, generator=g) for _ in range(n)]


@pytest.mark.parametrize("arch,quant", CASES, ids=[c[0] for c in CASES])
def test_every_expert_in_a_slot_gives_the_all_vram_bits(tmp_path, arch, quant):
    cfg, whole, split = _layers(tmp_path, arch, quant, "fast", None, 0)
    for h in _tokens(cfg, TOKENS, 1):
        h = h.to(DEVICE)
        w, ids = route(h, whole.router, whole.top_k, whole.normalize, whole.router_bias,
                       whole.gating)
        assert torch.equal(split.experts.mix(h, ids, w), whole.experts.mix(h, ids, w))
    assert split.experts.runtime.stats.expert_cpu_pairs == 0


@pytest.mark.parametrize("arch,quant", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_split_decode_and_prefill(tmp_path, arch, quant, precision):
    """2 experts in VRAM, 2 in RAM, the rest read from the file: decode tokens are the
    composition bit for bit and the all-VRAM bank within the bound; a prefill-sized pass
    (grouped by expert) too, within the bound."""
    cfg, whole, split = _layers(tmp_path, arch, quant, precision, 2, 2)
    bank: SplitExperts = split.experts
    for t, h in enumerate(_tokens(cfg, TOKENS, 2)):
        h = h.to(DEVICE)
        w, ids = route(h, whole.router, whole.top_k, whole.normalize, whole.router_bias,
                       whole.gating)
        ref = _composed(whole, split, h, ids, w)
        out = bank.mix(h, ids, w)
        _share_landed(bank)
        assert torch.equal(out, ref), (arch, precision)
        assert _rel(out, whole.experts.mix(h, ids, w)) <= TOL[precision]
        if t == 0:  # the layer's whole FFN as the block calls it: routing, then the bank
            assert _rel(moe_ffn(h, split), moe_ffn(h, whole)) <= TOL[precision]
    stats = bank.runtime.stats
    # each pass's pairs counted once, on one side (the composition's CPU sums are not)
    assert stats.expert_vram_pairs + stats.expert_cpu_pairs == (TOKENS + 1) * whole.top_k
    assert stats.expert_cpu_pairs > 0 and stats.expert_syncs == TOKENS + 1
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, cfg.hidden, generator=g).to(DEVICE)
    w, ids = route(h, whole.router, whole.top_k, whole.normalize, whole.router_bias,
                   whole.gating)
    assert _rel(bank.mix(h, ids, w), whole.experts.mix(h, ids, w)) <= TOL[precision]


@pytest.mark.parametrize("arch,quant", CASES, ids=[c[0] for c in CASES])
def test_swaps_move_the_hot_experts_into_vram_without_changing_a_slot(tmp_path, arch, quant):
    """Routing skewed towards experts outside VRAM: rounds every 2 tokens swap them in; each
    token after is still the composition bit for bit with the map of that moment, the stats
    count the swaps, and the slots end holding the experts routed to."""
    cfg, whole, split = _layers(tmp_path, arch, quant, "fast", 2, 1)
    bank: SplitExperts = split.experts
    bank.map.every = 2
    n = bank.n_experts
    hot = [n - 1, n - 2]  # on the CPU at the load (experts 0 and 1 fill the slots)
    assert not any(bank.map.in_vram(e) for e in hot)
    w = torch.tensor([[0.6, 0.4]], device=DEVICE)
    for t, h in enumerate(_tokens(cfg, 8, 4)):
        h = h.to(DEVICE)
        ids = torch.tensor([hot if t % 4 else [0, hot[0]]], device=DEVICE)
        before = list(bank.map.expert_in)
        out = bank.mix(h, ids, w)
        _share_landed(bank)
        # the round (if any) ran inside mix, before the token's experts: compare with the
        # map it left
        assert torch.equal(out, _composed(whole, split, h, ids, w)), (t, before,
                                                                      bank.map.expert_in)
        assert _rel(out, whole.experts.mix(h, ids, w)) <= TOL["fast"]
    assert sorted(bank.map.expert_in) == sorted(hot)
    assert bank.runtime.stats.expert_swaps == 2
    assert bank.runtime.stats.expert_swap_bytes > 0
    assert bank.slot_of.tolist() == bank.map.slot_of
    bank.runtime.close()  # the worker stopped; raises what it or a GPU wait ran into


# --- a prefill's experts outside VRAM streamed to staging slots (weights.expert_stream) -------

PREFILL_ROWS = 12  # above kernels.MAX_M: the all-VRAM bank groups such a pass by expert too


def _streaming(split, **rates):
    """The split layer's runtime with a streamer (default rates: every pass of several rows
    streams) and its counters zeroed."""
    from slipstream.weights.expert_stream import ExpertStreamer, StreamRates
    from slipstream.weights.split_experts import SplitCounts

    rt = split.experts.runtime
    rt.streamer = ExpertStreamer(rt, StreamRates(**(rates or dict(h2d_gbps=1e6,
                                                                  cpu_gbps=1.0))))
    rt.stats = SplitCounts()
    return rt.streamer


def _prefill(cfg, whole, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(PREFILL_ROWS, cfg.hidden, generator=g).to(DEVICE)
    w, ids = route(h, whole.router, whole.top_k, whole.normalize, whole.router_bias,
                   whole.gating)
    return h, w, ids


@pytest.mark.parametrize("arch,quant", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_streamed_prefill_gives_the_all_vram_bits(tmp_path, arch, quant, precision):
    """1 expert in VRAM, 2 in RAM, 3 in the file: a prefill pass streams the 5 others through
    3 staging slots (a slot reused), from RAM and from the file, and its sum is the all-VRAM
    bank's bit for bit; the counters name each streamed expert once."""
    cfg, whole, split = _layers(tmp_path, arch, quant, precision, 1, 2)
    bank: SplitExperts = split.experts
    _streaming(split)
    h, w, ids = _prefill(cfg, whole)
    out = bank.mix(h, ids, w)
    assert torch.equal(out, whole.experts.mix(h, ids, w)), (arch, precision)
    flat = ids.reshape(-1).tolist()
    outside = [e for e in flat if not bank.map.in_vram(e)]
    stats = bank.runtime.stats
    assert len(set(outside)) > 3  # more than the staging slots: one is reused
    assert stats.expert_streamed == len(set(outside))
    assert stats.expert_stream_pairs == len(outside) and stats.expert_cpu_pairs == 0
    assert stats.expert_vram_pairs == len(flat) - len(outside)
    per_expert = sum(sl.rows * sl.row_bytes for sl in bank.cpu.slices)
    bias = sum(r.numel() * 4 for r in bank.layout.bias_rows(0) if r is not None)
    assert stats.expert_stream_bytes == len(set(outside)) * (per_expert + bias)
    # the layer's whole FFN as the block calls it
    assert torch.equal(moe_ffn(h, split), moe_ffn(h, whole))


def test_stream_or_cpu_by_the_measured_rates(tmp_path):
    """Rates that make the CPU faster keep the pass on the CPU (the composition's bound, no
    expert streamed); a decode token never streams (tests/weights/test_expert_stream.py: the
    rule itself)."""
    cfg, whole, split = _layers(tmp_path, "qwen3moe", CASES[0][1], "fast", 1, 2)
    bank: SplitExperts = split.experts
    _streaming(split, h2d_gbps=1.0, cpu_gbps=1e6)
    h, w, ids = _prefill(cfg, whole)
    assert _rel(bank.mix(h, ids, w), whole.experts.mix(h, ids, w)) <= TOL["fast"]
    assert bank.runtime.stats.expert_streamed == 0 and bank.runtime.stats.expert_cpu_pairs > 0
    _streaming(split)
    out = bank.mix(h[:1], ids[:1], w[:1])
    _share_landed(bank)
    assert torch.equal(out, _composed(whole, split, h[:1], ids[:1], w[:1]))
    assert bank.runtime.stats.expert_streamed == 0


@pytest.mark.parametrize("fault", ["slot reused early", "wrong expert"])
def test_streaming_faults_are_caught(tmp_path, monkeypatch, fault):
    """Negative controls: a copy into a staging slot issued before the last read of the
    expert it held (one copy more in flight than slots), or a staged expert written with its
    neighbour's bytes, change the prefill's sum."""
    import slipstream.weights.expert_stream as expert_stream

    cfg, whole, split = _layers(tmp_path, "qwen3moe", CASES[0][1], "fast", 1, 2)
    bank: SplitExperts = split.experts
    streamer = _streaming(split)
    if fault == "slot reused early":
        streamer.ahead = streamer.slots + 1
    else:
        fill = expert_stream.ExpertStreamer._fill
        n = bank.n_experts

        def neighbour(self, bank, buf, e):
            return fill(self, bank, buf, 1 + e % (n - 1))  # never 0: the VRAM slot's

        monkeypatch.setattr(expert_stream.ExpertStreamer, "_fill", neighbour)
    h, w, ids = _prefill(cfg, whole)
    assert not torch.equal(bank.mix(h, ids, w), whole.experts.mix(h, ids, w))
