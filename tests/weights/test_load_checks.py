"""The load-time checks of weights.checks: a corrupt block scale, norm or bias is refused naming
the tensor, the block or element and the value; a renamed head or bias is refused naming both
names; unused tensors are reported in one warning line; SLIPSTREAM_CHECK_WEIGHTS=0 loads the
file anyway with the same text as a warning. Files are small synthetic models damaged through
the fuzzer's GGUF document (tests/fuzz/gguf_doc.py)."""

from __future__ import annotations

import math
import os
import random
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream import quant
from slipstream.errors import CorruptTensorValues, MisnamedTensor, TensorWarning
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import SynthShape, write_synth
from slipstream.weights import checks
from slipstream.weights.loader import load_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
from gguf_doc import TI, parse, relayout, serialize  # noqa: E402

MICRO = SynthShape(hidden=64, ffn=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab=300,
                   context=512, rope_base=10000.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("checks")
    return {
        "q8": write_synth(d / "q8.gguf", MICRO, "Q8_0"),
        "q4k": write_synth(d / "q4k.gguf", "tiny", "Q4_K_M", n_layers=1, from_floats=True,
                           std=0.05),
        "qwen2": write_synth(d / "qwen2.gguf", MICRO, "F16", arch="qwen2"),
        "tied": write_synth(d / "tied.gguf", MICRO, "Q8_0", tie_embeddings=True,
                            rope_freqs=True),
    }


def load(path: Path):
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    return load_weights(gf, cfg, CPU, Precision.of("fast", CPU))


def edited(src: Path, dst: Path, edit) -> Path:
    """`src` with `edit(doc)` applied (the data section laid out again where it returns
    True)."""
    doc = parse(src.read_bytes())
    if edit(doc):
        relayout(doc, random.Random(0))
    dst.write_bytes(serialize(doc))
    return dst


def tensor(doc, name: str) -> TI:
    return next(t for t in doc.tensors if t.name == name.encode())


def poke(doc, name: str, at: int, fmt: str, value: float) -> None:
    """Write `value` at byte `at` of tensor `name`'s data."""
    data = bytearray(doc.data)
    struct.pack_into(fmt, data, tensor(doc, name).offset + at, value)
    doc.data = bytes(data)


def rename(doc, old: str, new: str) -> None:
    tensor(doc, old).name = new.encode()


# -- block scales ------------------------------------------------------------------------------

def _blocks(qtype: GGMLQuantizationType, n: int, seed: int) -> np.ndarray:
    """`n` random blocks of `qtype` whose scale fields hold ordinary values (0.01)."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for offset, _, _ in checks.SCALE_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks


@pytest.mark.parametrize("qtype", list(checks.SCALE_FIELDS), ids=lambda t: t.name)
def test_scale_offsets_are_the_dequantizers(qtype):
    # a NaN written where the table says a scale lies makes that block, and only it, NaN in
    # the reference dequantizer: the offsets are the ones quant reads
    for offset, _, field in checks.SCALE_FIELDS[qtype]:
        blocks = _blocks(qtype, 8, seed=offset)
        assert checks.scale_outlier(blocks.reshape(-1), qtype) is None
        blocks[5, offset:offset + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        out = quant.get_format(qtype).dequantize_blocks(torch.from_numpy(blocks))
        finite = torch.isfinite(out).all(dim=1)
        assert finite.tolist() == [True] * 5 + [False] + [True] * 2, (qtype.name, field)
        hit = checks.scale_outlier(blocks.reshape(-1), qtype)
        assert hit is not None and hit[:2] == (field, 5) and math.isnan(hit[2])


@pytest.mark.parametrize("qtype", list(checks.SCALE_FIELDS), ids=lambda t: t.name)
def test_scale_limit_keeps_elements_in_float16(qtype):
    # every scale at its bound, every quantized code random: the dequantized block stays
    # within float16's range, so the bound flags nothing a float16 weight could hold
    blocks = _blocks(qtype, 256, seed=1)
    for offset, factor, _ in checks.SCALE_FIELDS[qtype]:
        bound = np.float16(checks.scale_limit(factor))
        bound = bound if float(bound) <= checks.scale_limit(factor) else np.nextafter(
            bound, np.float16(0))
        blocks[:, offset:offset + 2] = np.frombuffer(bound.tobytes(), np.uint8)
    assert checks.scale_outlier(blocks.reshape(-1), qtype) is None
    out = quant.get_format(qtype).dequantize_blocks(torch.from_numpy(blocks))
    n_fields = len(checks.SCALE_FIELDS[qtype])
    assert out.abs().max() <= checks.F16_MAX * n_fields  # d*q and an offset each within it


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(list(checks.SCALE_FIELDS)), data=st.data())
def test_scale_outlier_is_the_first_bad_scale(qtype, data):
    # random bytes, any float16 scales (NaN and inf included): the scan answers what a plain
    # loop over fields, then blocks, finds first
    n = data.draw(st.integers(1, 12), label="blocks")
    size = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="bytes seed"))
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    f16 = st.floats(width=16, allow_nan=True, allow_infinity=True)
    for offset, _, _ in checks.SCALE_FIELDS[qtype]:  # None: the random bytes' own scale
        scales = data.draw(st.lists(st.none() | f16, min_size=n, max_size=n))
        for b, value in enumerate(scales):
            if value is not None:
                blocks[b, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(),
                                                             np.uint8)
    want = None
    for offset, factor, field in checks.SCALE_FIELDS[qtype]:
        values = blocks[:, offset:offset + 2].copy().view(np.float16)[:, 0].astype(np.float64)
        bad = [b for b in range(n) if not abs(values[b]) <= checks.scale_limit(factor)]
        if bad:
            want = (field, bad[0], values[bad[0]], checks.scale_limit(factor))
            break
    got = checks.scale_outlier(blocks.reshape(-1), qtype)
    if want is None:
        assert got is None
    else:
        assert got is not None and got[:2] == want[:2] and got[3] == want[3]
        assert got[2] == want[2] or (math.isnan(got[2]) and math.isnan(want[2]))


# -- files: values -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-65504.0, float("nan"), float("inf"), 2000.0])
def test_corrupt_scale_refused(files, tmp_path, value):
    block = 3  # of blk.1.ffn_down.weight (Q8_0: 34 bytes, d first)
    path = edited(files["q8"], tmp_path / "s.gguf",
                  lambda d: poke(d, "blk.1.ffn_down.weight", block * 34, "<e", value))
    with pytest.raises(CorruptTensorValues) as e:
        load(path)
    msg = str(e.value)
    assert "'blk.1.ffn_down.weight' (Q8_0" in msg and f"in block {block} " in msg
    assert f"d = {value:.6g}" in msg and "SLIPSTREAM_CHECK_WEIGHTS=0" in msg


def test_k_quant_dmin_refused(files, tmp_path):
    # Q4_K: d at byte 0, dmin at byte 2 of a 144-byte block; blk.0.ffn_gate.weight is Q4_K
    path = edited(files["q4k"], tmp_path / "s.gguf",
                  lambda d: poke(d, "blk.0.ffn_gate.weight", 144 * 7 + 2, "<e", -3000.0))
    with pytest.raises(CorruptTensorValues, match=r"'blk\.0\.ffn_gate\.weight' \(Q4_K.* dmin "
                                                  r"= -3000 in block 7 "):
        load(path)


def test_plausible_scale_loads(files, tmp_path):
    # 500 is large but within the Q8_0 bound (65504/128 = 511.75): not refused
    path = edited(files["q8"], tmp_path / "s.gguf",
                  lambda d: poke(d, "blk.1.ffn_down.weight", 0, "<e", 500.0))
    load(path)


@pytest.mark.parametrize("value", [1e38, float("nan"), -2e4])
def test_corrupt_norm_refused(files, tmp_path, value):
    path = edited(files["q8"], tmp_path / "n.gguf",
                  lambda d: poke(d, "blk.0.ffn_norm.weight", 4 * 17, "<f", value))
    with pytest.raises(CorruptTensorValues) as e:
        load(path)
    want = f"{np.float32(value):.6g}"
    assert "'blk.0.ffn_norm.weight'" in str(e.value) and "at element 17" in str(e.value)
    assert f"norm value {want}" in str(e.value)


def test_corrupt_bias_refused(files, tmp_path):
    path = edited(files["qwen2"], tmp_path / "b.gguf",
                  lambda d: poke(d, "blk.1.attn_k.bias", 4 * 3, "<f", float("inf")))
    with pytest.raises(CorruptTensorValues, match=r"'blk\.1\.attn_k\.bias'.* bias value inf "
                                                  r"at element 3"):
        load(path)


def test_check_off_loads_with_the_same_text(files, tmp_path, monkeypatch):
    path = edited(files["q8"], tmp_path / "s.gguf",
                  lambda d: poke(d, "blk.1.attn_q.weight", 34 * 2, "<e", float("-inf")))
    with pytest.raises(CorruptTensorValues) as e:
        load(path)
    monkeypatch.setenv("SLIPSTREAM_CHECK_WEIGHTS", "0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        weights = load(path)
    found = [str(x.message) for x in w if issubclass(x.category, TensorWarning)]
    assert len(found) == 1 and found[0].split("; ")[0] == str(e.value).split("; ")[0]
    assert "loaded anyway" in found[0] and weights.layers[1] is not None


def test_streamed_layers_norms_checked_not_their_scales(files, tmp_path):
    path = edited(files["q8"], tmp_path / "s.gguf", lambda d: (
        poke(d, "blk.1.ffn_up.weight", 0, "<e", float("nan"))))
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    checks.check_values(gf, cfg, {0}, True, True)  # layer 1 streams: its weights unread
    with pytest.raises(CorruptTensorValues, match="blk.1.ffn_up.weight"):
        checks.check_values(gf, cfg, {0, 1}, True, True)
    path = edited(files["q8"], tmp_path / "n.gguf", lambda d: (
        poke(d, "blk.1.attn_norm.weight", 0, "<f", float("nan"))))
    gf = GGUFFile(path)
    with pytest.raises(CorruptTensorValues, match="blk.1.attn_norm.weight"):
        checks.check_values(gf, cfg, {0}, True, True)


def test_default_model_passes_and_its_cost(smollm_path):
    gf = GGUFFile(smollm_path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    checks.check_values(gf, cfg, None, True, True)  # faults the pages in, as a load would
    t0 = time.perf_counter()
    checks.check_values(gf, cfg, None, True, True)
    ms = (time.perf_counter() - t0) * 1e3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checks.check_tensor_names(gf, cfg)
    print(f"\nvalue checks of the default model ({gf.file_size / 1e6:.0f} MB): {ms:.1f} ms")
    assert ms < 1000  # 11 ms on an idle 2-core machine, 40 on a busy one


# -- files: names ------------------------------------------------------------------------------

def test_renamed_head_refused(files, tmp_path, monkeypatch):
    path = edited(files["q8"], tmp_path / "h.gguf",
                  lambda d: rename(d, "output.weight", "output_w.weight"))
    with pytest.raises(MisnamedTensor, match=r"no 'output\.weight' but holds the unused tensor "
                                             r"'output_w\.weight' of its shape \[300, 64\]"):
        load(path)
    monkeypatch.setenv("SLIPSTREAM_CHECK_WEIGHTS", "0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load(path)
    text = [str(x.message) for x in w if issubclass(x.category, TensorWarning)]
    assert len(text) == 2 and "tied token embedding" in text[0]
    assert "1 tensor(s) the model does not use, ignored: 'output_w.weight'" in text[1]


@pytest.mark.parametrize("old,new", [("blk.1.attn_k.bias", "blk.1.attn_k.biaz"),
                                     ("blk.0.attn_q.bias", "blk.0.attn_q.bias_"),
                                     ("blk.0.attn_v.bias", "blk.0.xyz")])
def test_renamed_bias_refused(files, tmp_path, old, new):
    path = edited(files["qwen2"], tmp_path / "b.gguf", lambda d: rename(d, old, new))
    with pytest.raises(MisnamedTensor, match=f"tensor '{old}' is missing while 5 of the 6 "):
        load(path)


def test_all_biases_renamed_refused(files, tmp_path):
    def edit(doc):
        for t in doc.tensors:
            if t.name.endswith(b".bias"):
                t.name = t.name.replace(b".bias", b".b1as")
    path = edited(files["qwen2"], tmp_path / "b.gguf", edit)
    with pytest.raises(MisnamedTensor, match=r"no 'blk\.0\.attn_q\.bias' but holds the unused "
                                             r"tensor 'blk\.0\.attn_q\.b1as'.*attention biases"):
        load(path)


def test_renamed_rope_freqs_refused(files, tmp_path):
    path = edited(files["tied"], tmp_path / "r.gguf",
                  lambda d: rename(d, "rope_freqs.weight", "rope_freq.weight"))
    with pytest.raises(MisnamedTensor, match=r"no 'rope_freqs\.weight'.*'rope_freq\.weight'"):
        load(path)


def test_unknown_tensors_one_line(files, tmp_path):
    def edit(doc):
        for k in range(7):
            doc.tensors.append(TI(f"extra.{k}.weight".encode(), [64], 0, 0, (0, 256)))
        return True
    path = edited(files["q8"], tmp_path / "u.gguf", edit)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load(path)
    text = [str(x.message) for x in w if issubclass(x.category, TensorWarning)]
    assert text == ["u.gguf: 7 tensor(s) the model does not use, ignored: 'extra.0.weight', "
                    "'extra.1.weight', 'extra.2.weight', 'extra.3.weight', 'extra.4.weight' and "
                    "2 more; a renamed tensor would show here"]


def test_clean_files_load_without_warnings(files):
    for path in files.values():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load(path)


@pytest.mark.slow
def test_cli_one_line(files, tmp_path):
    """`slipstream run`: a corrupt scale is one `error:` line and exit 1; an unused tensor one
    `warning:` line and a normal run."""
    bad = edited(files["q8"], tmp_path / "bad.gguf",
                 lambda d: poke(d, "blk.0.attn_v.weight", 0, "<e", -65504.0))
    def add_extra(doc):
        doc.tensors.append(TI(b"extra.weight", [64], 0, 0, (0, 256)))
        return True  # laid out again
    extra = edited(files["q8"], tmp_path / "extra.gguf", add_extra)
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    outs = {}
    for name, path in (("bad", bad), ("extra", extra)):
        outs[name] = subprocess.run(
            [sys.executable, "-m", "slipstream", "run", "-m", str(path), "-p", "hi", "-n", "1",
             "--device", "cpu", "--ctx", "64"], capture_output=True, text=True, timeout=300,
            env=env)
    r = outs["bad"]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: bad.gguf: "
                                                                       "tensor 'blk.0.attn_v")
    r = outs["extra"]
    warned = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert r.returncode == 0, r.stderr
    assert warned == ["warning: extra.gguf: 1 tensor(s) the model does not use, ignored: "
                      "'extra.weight'; a renamed tensor would show here"]


def test_longrope_factors_are_read_not_reported_unused(tmp_path):
    """Phi-3's rope_factors_short/long are read by the load wherever a file holds them, so
    the unused-tensor warning must not name them (it once did, on every Phi-3 file)."""
    from slipstream.synth import write_synth
    from slipstream.weights.checks import check_tensor_names, used_tensors

    path = write_synth(tmp_path / "phi3.gguf", "tiny", "Q8_0", n_layers=2, arch="phi3")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    assert {"rope_factors_short.weight", "rope_factors_long.weight"} <= used_tensors(gf, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TensorWarning)
        check_tensor_names(gf, cfg)
