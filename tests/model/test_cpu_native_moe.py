"""A CPU decode token's mixture-of-experts layer in one native call (model.cpu_native_moe,
native/decode_moe_layer.c) against the torch path's ops (model.llama with CPU_NATIVE off),
which compute the same math with other sums: the logits agree to the bfloat16 rounding both
paths apply at the matvecs. A layer's routing handed back to the bank (as a bank reading its
experts from the file gets it) gives the one call's bits, so resident and tiered banks agree."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_engine, refuse_expert_loop
from slipstream import native
from slipstream.model import llama
from slipstream.model import cpu_native_moe
from slipstream.synth import write_synth

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

IDS = list(range(5, 200, 13))  # 15 tokens of the synthetic vocabulary


@pytest.fixture(scope="module", params=[("qwen3moe", "Q4_K"), ("mixtral", "Q4_K"),
                                        ("qwen3moe", "Q4_K_M")], ids="-".join)
def moe_file(request, tmp_path_factory):
    """A 2-layer file: Qwen3-MoE's block (per-head q/k norms, 16 experts, top 4) or Mixtral's
    (none, 8 experts, top 2); Q4_K, or Q4_K_M (q/k/v of two layouts: Q6_K v)."""
    arch, mix = request.param
    d = tmp_path_factory.mktemp(arch)
    return write_synth(d / "m.gguf", "tiny", mix, n_layers=2, arch=arch,
                       from_floats=True, seed=9, std=0.15)


def _decode(engine, n: int = len(IDS)) -> torch.Tensor:
    engine.reset()
    return torch.cat([engine.forward(IDS[i:i + 1]) for i in range(n)]).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _torch_path(engine, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(llama, "CPU_NATIVE", False)
        return _decode(engine)


def test_one_call_layer_matches_the_torch_path(moe_file, monkeypatch):
    engine = cpu_engine(moe_file, ctx=64)
    ref = _torch_path(engine, monkeypatch)
    # the native layer, with the torch path's attention and the experts' loop made to fail
    with monkeypatch.context() as m:
        refuse_expert_loop(m)
        m.setattr(llama, "decode_attention", None)
        ours = _decode(engine)
    for layer in engine.weights.layers:
        assert isinstance(layer.moe.cpu_native, cpu_native_moe.MoeNativeLayer)
        assert layer.moe.cpu_native.summed  # the resident experts summed in the call
        # one q/k/v matvec, or one per part where they mix layouts
        parts = getattr(layer.attn_qkv.packed, "parts", [None])
        assert layer.moe.cpu_native.desc.n_qkv == len(parts)
    assert _rel(ours, ref) < 2e-2, _rel(ours, ref)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # one thread or two: the same bits (the experts' sum is ordered by id, not by thread)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_decode(engine), ours)
    finally:
        torch.set_num_threads(threads)


def test_weights_not_renormalised_miss_the_torch_path(moe_file, monkeypatch):
    """Negative control: the same call with the top-k weights left unnormalised (a routing
    slip the comparison above must see) lands far from the torch path."""
    engine = cpu_engine(moe_file, ctx=64)
    ref = _torch_path(engine, monkeypatch)
    _decode(engine, 1)  # the layers' native forms made
    for layer in engine.weights.layers:
        layer.moe.cpu_native.desc.normalize = 0
    assert _rel(_decode(engine), ref) > 5e-2


def test_routing_handed_back_gives_the_same_bits(moe_file, monkeypatch):
    """Without the experts' table (a bank that reads its experts from the file has none), the
    call returns the routing and the bank's own one-token sum adds the experts: the same bits
    as summing them inside the call."""
    engine = cpu_engine(moe_file, ctx=64)
    inside = _decode(engine)
    monkeypatch.setattr(cpu_native_moe, "_expert_table", lambda bank: None)
    for layer in engine.weights.layers:
        layer.moe.cpu_native = None
    handed_back = _decode(engine)
    assert all(not layer.moe.cpu_native.summed for layer in engine.weights.layers)
    assert torch.equal(handed_back, inside)
