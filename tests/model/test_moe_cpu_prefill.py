"""A CPU mixture of experts at precision "fast" on a pass of several rows: one native call a
layer (weights.cpu.expert_rows, native/moe_rows.c) rather than experts_ffn's expert by expert:
Qwen3-MoE's SwiGLU experts (q4vnni, q6vnni and q8vnni; IQ4_XS's through cb4) and gpt-oss's
(MXFP4 through cb4, a bias on gate, up and down, the clamped SwiGLU).

The oracles: float64 products of gguf-py's dequantization of the experts' slices, with the
file's biases and the activation written out op by op (the
native call's own error is its 16-bit activations', as a decode token's, far under 1e-3),
and the per-expert path it replaces (experts_ffn over native_expert_ffn), whose bits it
must give whatever the thread count or the chunking, as must each row alone through the
decode token's sum (native_expert_sum). A negative control (the ids shifted by one) misses
the reference."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGUFReader

from helpers import cpu_engine
from slipstream import native
from slipstream.model.moe import OAI_ALPHA, OAI_LIMIT, experts_ffn, route
from slipstream.quant.requantize import requantize
from slipstream.synth import write_synth
from slipstream.weights.cpu.expert_decode import native_expert_sum
from slipstream.weights.cpu.expert_rows import NativeExpertRows
from slipstream.weights.cpu.q6vnni import q6vnni_available

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

IDS = list(range(7, 300, 11))  # 27 tokens of the synthetic vocabulary


@pytest.fixture(scope="module", params=["Q4_K", pytest.param("Q4_K_M", marks=pytest.mark.slow),
                                        "Q8_0", "gpt-oss-MXFP4",
                                        pytest.param("IQ4_XS", marks=pytest.mark.slow)])
def moe_file(request, tmp_path_factory):
    """A 2-layer qwen3moe file (16 experts, 4 a token): Q4_K experts, Q4_K_M's (down in Q6_K:
    q6vnni), Q8_0's or IQ4_XS's (re-encoded from Q8_0: cb4); or a 2-layer gpt-oss file (8
    experts, 2 a token) with MXFP4 experts (cb4) and their biases."""
    if request.param == "Q4_K_M" and not q6vnni_available():
        pytest.skip("no q6vnni here (its VNNI loop)")
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt-oss-MXFP4":
        return write_synth(d / "m.gguf", "tiny", "MXFP4", n_layers=2, arch="gpt-oss", seed=3,
                           std=0.15)
    if request.param == "IQ4_XS":
        q8 = write_synth(d / "q8.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen3moe", seed=5,
                         std=0.15)
        return requantize(q8, d / "m.gguf", "IQ4_XS", fallback="IQ4_NL")
    return write_synth(d / "m.gguf", "tiny", request.param, n_layers=2, arch="qwen3moe",
                       from_floats=True, seed=5, std=0.15)


@pytest.fixture(scope="module")
def engine(moe_file):
    return cpu_engine(moe_file, ctx=64)


def _expert_weights(path, layer: int = 0) -> dict[str, np.ndarray]:
    """gguf-py's dequantization of layer `layer`'s expert tensors, (n_experts, rows, cols),
    and their biases where the file has them (gpt-oss's), (n_experts, rows)."""
    out = {}
    for t in GGUFReader(path).tensors:
        for part in ("gate", "up", "down"):
            for kind in ("weight", "bias"):
                if t.name == f"blk.{layer}.ffn_{part}_exps.{kind}":
                    a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
                    out[part + "_" * (kind == "bias")] = a.reshape(
                        [int(d) for d in reversed(t.shape)])
    return out


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gated product as transformers' GptOssExperts writes it, in float64."""
    gate = gate.clamp(max=OAI_LIMIT)
    up = up.clamp(-OAI_LIMIT, OAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(OAI_ALPHA * gate)


def _reference(w: dict[str, np.ndarray], ids: torch.Tensor, weights: torch.Tensor,
               h: torch.Tensor, act: str = "silu", biases: bool = True) -> torch.Tensor:
    """Each row's routed experts in float64, op by op; `biases`: the file's (False: a
    negative control)."""
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        x = h[t].double()
        for e, wt in zip(ids[t].tolist(), weights[t].double()):
            gate, up, down = (torch.from_numpy(w[p][e]) for p in ("gate", "up", "down"))
            bg, bu, bd = (torch.from_numpy(w[p + "_"][e]) if biases and p + "_" in w else 0
                          for p in ("gate", "up", "down"))
            g, u = gate @ x + bg, up @ x + bu
            prod = _swiglu_oai(g, u) if act == "swiglu_oai" else F.silu(g) * u
            out[t] += wt * (down @ prod + bd)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _routed(engine, rows: int, seed: int):
    moe = engine.weights.layers[0].moe
    h = torch.randn(rows, engine.cfg.hidden, generator=torch.Generator().manual_seed(seed))
    weights, ids = route(h, moe.router, moe.top_k)
    return moe.experts, h, ids, weights


def test_mix_is_the_experts_to_float64(moe_file, engine):
    bank, h, ids, weights = _routed(engine, 23, 1)
    assert isinstance(bank.many, NativeExpertRows)
    ours = bank.many(bank.gate_up, bank.down, h, ids, weights, bank.act)
    assert ours is not None  # the one call served it
    w = _expert_weights(moe_file)
    ref = _reference(w, ids, weights, h, bank.act)
    assert ours.dtype == torch.float32 and ours.shape == h.shape
    assert _rel(ours, ref) < 1e-3, _rel(ours, ref)
    shifted = (ids + 1) % bank.n_experts  # negative controls: other experts,
    assert _rel(bank.mix(h, shifted, weights), ref) > 0.1
    if bank.act == "swiglu_oai":  # the plain SwiGLU, no biases
        assert _rel(ours, _reference(w, ids, weights, h, "silu")) > 0.1
        assert _rel(ours, _reference(w, ids, weights, h, bank.act, biases=False)) > 0.01


@pytest.mark.parametrize("rows", [2, 64, 150])
def test_mix_gives_the_per_expert_paths_bits(engine, rows):
    """The one call against experts_ffn over each expert's native_expert_ffn: the same bits,
    on 1 and 2 threads; 150 rows of 4 experts in 16 put ~37 rows on an expert, past the
    32-row chunks that the threads share."""
    bank, h, ids, weights = _routed(engine, rows, rows)
    assert torch.bincount(ids.view(-1)).max() > 32 or rows < 150
    per_expert = experts_ffn(h, ids, weights, bank)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(bank.mix(h, ids, weights), per_expert), n
    finally:
        torch.set_num_threads(threads)


def test_each_row_gets_a_decode_tokens_bits(engine):
    """A row of a pass is the decode token's one-call sum of its experts (ascending ids)."""
    bank, h, ids, weights = _routed(engine, 17, 3)
    batch = bank.mix(h, ids, weights)
    for t in range(17):
        order = torch.argsort(ids[t])
        pairs = [(bank.gate_up[e], bank.down[e]) for e in ids[t][order].tolist()]
        one = native_expert_sum(pairs, weights[t][order].contiguous(), h[t:t + 1], bank.act)
        assert torch.equal(one, batch[t:t + 1]), t


def test_long_passes_go_in_slices_with_the_same_bits(engine, monkeypatch):
    bank, h, ids, weights = _routed(engine, 40, 4)
    whole = bank.mix(h, ids, weights)
    monkeypatch.setattr("slipstream.weights.cpu.expert_rows.MAX_ROWS", 7)
    assert torch.equal(bank.mix(h, ids, weights), whole)


def test_bad_input_is_named(engine):
    bank, h, ids, weights = _routed(engine, 5, 5)
    bad = ids.clone()
    bad[3, 1] = bank.n_experts
    with pytest.raises(ValueError, match=f"expert id {bank.n_experts} \\(row 3, slot 1\\)"):
        bank.mix(h, bad, weights)
    with pytest.raises(ValueError, match="rows"):
        bank.mix(h[:, :-32], ids, weights)


def test_prefill_takes_the_one_call(engine, monkeypatch):
    """A prefill's experts go through the native call (experts_ffn made to fail), with the
    logits the per-expert path gives, bit for bit (27 rows: every expert under the per-expert
    path's packed limit)."""
    def refuse(*args, **kwargs):
        raise AssertionError("experts_ffn ran")

    engine.reset()
    monkeypatch.setattr("slipstream.model.moe.experts_ffn", refuse)
    ours = engine.forward(IDS, all_logits=True)
    monkeypatch.undo()
    banks = [layer.moe.experts for layer in engine.weights.layers]
    kept = [bank.many for bank in banks]
    try:
        for bank in banks:
            bank.many = None
        engine.reset()
        per_expert = engine.forward(IDS, all_logits=True)
    finally:
        for bank, many in zip(banks, kept):
            bank.many = many
    assert torch.equal(ours, per_expert)
