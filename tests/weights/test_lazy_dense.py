"""CPU dense weights made at their first use: a load makes none of them, and the ones made later
carry the bits the eager build makes (so prefill's logits do not change)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.cpu import PackedDecodeLinear
from slipstream.weights.linear import DenseLinear, LazyDenseLinear
from slipstream.weights.loader import LayerBuilder, TensorSource, layer_span, private_file_bytes

CPU = torch.device("cpu")
FIELDS = ("attn_qkv", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_up", "ffn_gate",
          "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    # Q4_K_M mixes formats (Q6_K rows among Q4_K): groups that pack and groups that stay dense
    return write_synth(tmp_path_factory.mktemp("lazy") / "m.gguf", "tiny", "Q4_K_M", seed=5,
                       n_layers=2)


def _dense(lin) -> DenseLinear:
    return lin.dense if isinstance(lin, PackedDecodeLinear) else lin


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_lazy_layer_is_the_eager_layer_bit_for_bit(model_path, precision):
    gf = GGUFFile(model_path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    prec = Precision.of(precision, CPU)
    start, end = layer_span(gf, 1)
    staged = torch.frombuffer(bytearray(model_path.read_bytes()[start:end]), dtype=torch.uint8)
    eager = LayerBuilder(cfg, CPU, prec).build(TensorSource(gf, buffer=staged, base=start), 1)
    held, base = private_file_bytes(gf)
    lazy = LayerBuilder(cfg, CPU, prec).build(
        TensorSource(gf, held, base, private=True, held=True), 1)
    x = torch.randn(16, cfg.hidden)
    checked = 0
    for name in FIELDS:
        e, lz = getattr(eager, name), getattr(lazy, name)
        if e is None:
            assert lz is None
            continue
        ed, ld = _dense(e), _dense(lz)
        assert isinstance(ld, LazyDenseLinear) and not ld.materialized
        assert type(ed) is DenseLinear
        assert torch.equal(ld.weight, ed.weight) and ld.weight.dtype == ed.weight.dtype
        assert ld.materialized
        if ed.weight.shape[1] == cfg.hidden:
            assert torch.equal(lz(x), e(x))  # 16 rows: prefill's path
        checked += 1
    assert checked >= 5


def test_cpu_load_leaves_dense_weights_to_a_thread_and_the_head_to_its_first_use(model_path,
                                                                              monkeypatch):
    # with packed prefill (the default), so that both kinds of linear are here
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", "1")
    ids = list(range(1, 21))  # 20 rows: prefill, the dense weights
    racing = slipstream.load(model_path, device="cpu", ctx=64)
    try:  # a prefill at once, racing the prefetch thread for the layers' weights
        raced = racing.logits(ids)
    finally:
        racing.close()
    m = slipstream.load(model_path, device="cpu", ctx=64)
    try:
        w = m.engine.weights
        head = _dense(w.output)
        lins = [getattr(layer, f) for layer in w.layers for f in FIELDS
                if getattr(layer, f) is not None]
        lazies = [_dense(lin) for lin in lins]
        assert all(isinstance(d, LazyDenseLinear) for d in [head, *lazies])
        w.dense_prefetch.join(timeout=60)
        packed_prefill = {id(lin.dense) for lin in lins
                          if isinstance(lin, PackedDecodeLinear) and lin.packed_prefill}
        assert packed_prefill  # Q4_K and Q6_K: the native layouts
        for lin, d in zip(lins, lazies):
            if id(d) in packed_prefill or id(d.of) in packed_prefill:
                # a prefill multiplies the packed copy: the thread packs it, and the dense
                # weight (and its parts' views) wait for a path that asks for them
                assert not d.materialized
                assert not isinstance(lin, PackedDecodeLinear) or lin.is_packed
            else:
                assert d.materialized
        assert not head.materialized  # only passes scoring every row need it
        # the head's decode copy, which scores a prompt's last row, is made by the thread too
        assert isinstance(w.output, PackedDecodeLinear) and w.output.is_packed
        assert torch.equal(m.logits(ids), raced)
        # every row's logits: the head's packed copy where it serves prefill, else its dense
        assert head.materialized != w.output.packed_prefill
    finally:
        m.close()


@pytest.mark.slow
def test_exit_right_after_a_load_waits_for_no_prefetch_and_does_not_abort(smollm_path):
    # the prefetch thread is still dequantizing the default model's layers at exit
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, slipstream; "
                           "slipstream.load(sys.argv[1], device='cpu')", str(smollm_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
