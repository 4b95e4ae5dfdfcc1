"""Hybrid decode's split of a layer's FFN (hybrid.split, hybrid.share) on the CPU: the two shares add up to
the whole layer, and the CPU's packed share matches it within the bfloat16 rounding of its
kernels, for Llama's SwiGLU and for Gemma 3's GeGLU with its post-FFN norm (the partial sums
meet before the norm). The GPU side (images, the store's modes) is tested in
tests/gpu/test_hybrid_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.model.llama import _ffn
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.hybrid import share
from slipstream.hybrid.host_io import HostIO, Scratch
from slipstream.hybrid.share import HostFFN, host_linears
from slipstream.hybrid.split import (column_slice, ffn_raws, layer_splittable, split_layer,
                                     split_point)
from slipstream.weights.loader import LayerBuilder, TensorSource

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["Q4_K", "Q4_K_M", "Q8_0", "Q4_0", "gemma3:Q4_K",
                                        "gemma3:Q4_0"])
def layer_parts(request, tmp_path_factory):
    arch, _, qtype = request.param.rpartition(":")
    path = write_synth(tmp_path_factory.mktemp("hy") / "t.gguf", "tiny", qtype,
                       from_floats=True, std=0.05, seed=3, arch=arch or "llama")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    builder = LayerBuilder(cfg, CPU, Precision.of("exact", CPU))
    return cfg, builder, TensorSource(gf)


def test_split_point_rounds_to_whole_blocks_and_checks_the_share():
    assert split_point(28672, 0.5) == 14336
    assert split_point(28672, 0.0) == 28672 and split_point(28672, 1.0) == 0
    assert split_point(1000 * 256, 0.3) % 256 == 0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        split_point(512, 1.5)


def test_column_slice_takes_whole_blocks_of_each_row(layer_parts):
    cfg, _, src = layer_parts
    raws = ffn_raws(src, cfg, 0)
    q = raws.qtypes["ffn_down"]
    from gguf.quants import dequantize

    whole = torch.from_numpy(dequantize(raws.down.numpy(), q)).reshape(cfg.hidden, cfg.ffn)
    part = column_slice(raws.down, q, cfg.hidden, cfg.ffn, 256, 512)
    got = torch.from_numpy(dequantize(part.numpy(), q)).reshape(cfg.hidden, 256)
    assert torch.equal(got, whole[:, 256:512])
    with pytest.raises(ValueError, match="blocks"):
        column_slice(raws.down, q, cfg.hidden, cfg.ffn, 100, 512)


def test_the_two_shares_add_up_to_the_whole_ffn(layer_parts):
    cfg, builder, src = layer_parts
    assert layer_splittable(src, cfg, 0)
    whole = builder.build(src, 0)
    split = split_layer(builder, src, 0, 256)
    assert split.ffn_gate_up.out_features == 2 * 256
    x = torch.randn(3, cfg.hidden, generator=torch.Generator().manual_seed(0))
    ref, got = _ffn(cfg, whole, x), _ffn(cfg, split, x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_cpu_share_matches_within_bfloat16_rounding(layer_parts):
    cfg, builder, src = layer_parts
    whole = builder.build(src, 0)
    split = split_layer(builder, src, 0, 256)
    parts = host_linears(ffn_raws(src, cfg, 0), 256)
    gate_up, down = parts["gate_up"], parts["down"]
    io = HostIO(CPU, cfg.hidden, max_tokens=8)
    hybrid = dataclasses.replace(split, ffn_gate_up_rest=None, ffn_down_rest=None,
                                 ffn_host=HostFFN(gate_up, down, io, act=cfg.ffn_act))
    x = torch.randn(2, cfg.hidden, generator=torch.Generator().manual_seed(1))
    ref, got = _ffn(cfg, whole, x) - x, _ffn(cfg, hybrid, x) - x  # the FFN's own output
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel  # bfloat16 activations and scales (weights.cpu's torch kernels)
    # the CPU's share is half the units: without it the output is far off
    part = _ffn(cfg, dataclasses.replace(split, ffn_down_rest=None, ffn_gate_up_rest=None),
                x) - x
    assert ((part - ref).norm() / ref.norm()).item() > 10 * rel
    assert io.stats.cpu_bytes == gate_up.nbytes + down.nbytes and io.stats.cpu_s > 0
    with pytest.raises(ValueError, match="at most 8 tokens"):
        hybrid.ffn_host.start(torch.zeros(9, cfg.hidden))


@pytest.mark.parametrize("q4vnni", ["1", "0"])
def test_the_workers_path_gives_computes_bits(layer_parts, q4vnni, monkeypatch):
    """HostFFN.compute_into (the CUDA worker's path: its buffers reused, the result written in
    place) gives compute's bits for 1 to 8 rows, whatever the CPU kernels are: the layer's own
    share packed as q4vnni, q8vnni (q6vnni or int8pack for Q6_K), or with SLIPSTREAM_Q4VNNI=0
    by torch's kernels (int4pack, no output buffer of its own: through compute)."""
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", q4vnni)
    cfg, builder, src = layer_parts
    parts = host_linears(ffn_raws(src, cfg, 0), 256)
    gate_up, down = parts["gate_up"], parts["down"]
    ffn = HostFFN(gate_up, down, HostIO(CPU, cfg.hidden, max_tokens=8), act=cfg.ffn_act)
    scratch = Scratch()
    g = torch.Generator().manual_seed(5)
    for m in (1, 8, 3):  # the scratch grows, then serves a smaller call
        h = torch.randn(m, cfg.hidden, generator=g)
        out = torch.full((m, cfg.hidden), float("nan"))
        ffn.compute_into(h, out, scratch)
        assert torch.equal(out, ffn.compute(h).float()), m


def test_the_fused_share_is_the_four_calls_in_one(layer_parts):
    """Where both CPU linears are q4vnni/q8vnni, the share is one native call (ss_q4_ffn: the
    two matvecs and the SwiGLU or GeGLU between them): it matches the four calls it replaces
    (the matvecs and torch's activation and product) to float32 rounding of the activation,
    which the second matvec's 16-bit activations may carry to a last few bits, for 1 to 8
    rows; the other activation is far off (the native call heeds the family's)."""
    from slipstream import native
    from slipstream.model.llama import gated

    cfg, builder, src = layer_parts
    parts = host_linears(ffn_raws(src, cfg, 0), 256)
    ffn = HostFFN(parts["gate_up"], parts["down"], HostIO(CPU, cfg.hidden, max_tokens=8),
                  act=cfg.ffn_act)
    kinds = {getattr(p, "kind", None) for p in parts.values()}
    if native.library() is None or not kinds <= {"q4vnni", "q8vnni"}:
        assert ffn._fused() is None  # Q4_K_M's Q6_K down is no q4vnni: four calls
        return
    assert ffn._fused() is not None
    g = torch.Generator().manual_seed(9)
    for m in (1, 8, 3):
        h = torch.randn(m, cfg.hidden, generator=g)
        fused = torch.full((m, cfg.hidden), float("nan"))
        ffn.compute_into(h, fused, Scratch())
        units = ffn.down.in_features
        gate_up = ffn.gate_up.matvec(h, torch.empty(m, 2 * units))
        assert gate_up.shape[1] == 2 * units
        calls, other = (ffn.down.matvec(gated(a, gate_up).contiguous(),
                                        torch.full((m, cfg.hidden), float("nan")))
                        for a in (cfg.ffn_act, "gelu_tanh" if cfg.ffn_act == "silu" else "silu"))
        torch.testing.assert_close(fused, calls, rtol=1e-4, atol=1e-4 * calls.abs().max().item())
        assert not torch.equal(fused, torch.zeros_like(fused))
        assert (fused - other).abs().max() > 100 * (fused - calls).abs().max()


def test_the_share_on_signal_waits_for_the_flag_then_hands_back(layer_parts, monkeypatch):
    """SLIPSTREAM_HOST_SIGNAL's native call (ss_q4_ffn_on_signal): nothing is computed and the
    counter stays until the arrival flag reaches the job's number; then the share is compute_into's,
    bit for bit, and the counter takes the number. An input that never arrives gives up after
    SIGNAL_TIMEOUT_S with an error, the counter untouched."""
    import threading
    import time

    from slipstream import native

    cfg, builder, src = layer_parts
    parts = host_linears(ffn_raws(src, cfg, 0), 256)
    ffn = HostFFN(parts["gate_up"], parts["down"], HostIO(CPU, cfg.hidden, max_tokens=8),
                  act=cfg.ffn_act)
    if native.library() is None or ffn._fused() is None:
        pytest.skip("no fused share for these formats here (Q4_K_M's Q6_K down, or no "
                    "native library)")
    h = torch.randn(2, cfg.hidden, generator=torch.Generator().manual_seed(11))
    want = torch.empty(2, cfg.hidden)
    ffn.compute_into(h, want, Scratch())
    arrived, done = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    out = torch.full((2, cfg.hidden), float("nan"))
    waited: list[float] = []
    worker = threading.Thread(target=lambda: waited.append(
        ffn.compute_on_signal(h, out, Scratch(), arrived, 3, done, 1)))
    worker.start()
    time.sleep(0.1)
    assert worker.is_alive() and int(done[0]) == 0 and out.isnan().all()
    arrived[0] = 2  # an earlier job's number: still waiting
    time.sleep(0.05)
    assert worker.is_alive() and int(done[0]) == 0
    arrived[0] = 3
    worker.join(timeout=30)
    assert not worker.is_alive() and int(done[0]) == 3
    assert torch.equal(out, want) and waited[0] >= 0.14
    monkeypatch.setattr(share, "SIGNAL_TIMEOUT_S", 0.05)
    with pytest.raises(RuntimeError, match="did not arrive"):
        ffn.compute_on_signal(h, out, Scratch(), arrived, 4, done, 1)
    assert int(done[0]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_gil_switch_interval_is_named_where_it_is_read(value):
    """SLIPSTREAM_GIL_SWITCH_S is read when the CPU worker starts, not at import: the modules
    import whatever it says, and a value that is no number of seconds >= 0 is a BadArgument
    naming it, not a bare ValueError."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SLIPSTREAM_GIL_SWITCH_S=value)
    code = ("import slipstream.hybrid.host_io, slipstream.hybrid.policy\n"
            "from slipstream import envs\n"
            "envs.get('SLIPSTREAM_GIL_SWITCH_S')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "BadArgument" in r.stderr and f"SLIPSTREAM_GIL_SWITCH_S={value!r}" in r.stderr


def test_split_layer_refuses_a_split_off_the_blocks(layer_parts):
    cfg, builder, src = layer_parts
    with pytest.raises(ValueError, match="multiples of 256"):
        split_layer(builder, src, 0, 100)
    with pytest.raises(ValueError, match="0 < keep"):
        split_layer(builder, src, 0, cfg.ffn)

