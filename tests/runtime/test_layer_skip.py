"""Layer skip (runtime.layer_skip): calibration, the choice of layers, and an engine that
leaves the chosen layers out, neither acquiring (so never streaming) nor computing them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slipstream
from helpers import cpu_engine, patch
from slipstream.errors import BadArgument
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory.disk import DirectReader
from slipstream.runtime.layer_skip import calibrate, calibration_text, choose
from slipstream.synth import write_synth
from slipstream.weights.loader import layer_span

N_LAYERS = 6
PROMPT = [5, 77, 300, 12, 901, 44, 7, 8, 19, 640]


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("skip")
    return write_synth(d / "m.gguf", "tiny", "Q4_K", n_layers=N_LAYERS, from_floats=True,
                       std=0.08, seed=4)


@pytest.fixture(scope="module")
def identity_at_2(synth, tmp_path_factory) -> Path:
    """The same model with layer 2 made an exact identity: its attn_output and ffn_down
    weights are all zero bytes (a zero scale dequantizes every Q4_K block to 0), so both
    residual branches add exactly 0."""
    path = tmp_path_factory.mktemp("identity") / "m.gguf"
    path.write_bytes(synth.read_bytes())
    gf = GGUFFile(path)
    spans = [(gf.tensors[f"blk.2.{n}.weight"].offset, gf.tensors[f"blk.2.{n}.weight"].n_bytes)
             for n in ("attn_output", "ffn_down")]
    gf.close()
    for offset, n in spans:
        patch(path, offset, bytes(n))
    return path


def _run(engine, steps: int = 4) -> list[torch.Tensor]:
    """Prefill logits, then greedy decode steps."""
    engine.reset()
    out = [engine.forward(PROMPT, all_logits=True)]
    tok = torch.tensor([int(out[0][-1].argmax())])
    for _ in range(steps):
        logits = engine.decode(tok)
        out.append(logits)
        tok = logits[-1].argmax().view(1)
    return out


# --- calibrate ------------------------------------------------------------------------------


@pytest.mark.slow
def test_calibration_gives_one_similarity_per_layer_deterministically(synth):
    engine = cpu_engine(synth, ctx=64)
    ids = list(range(3, 200, 2))  # 99 tokens: two passes of 64
    sims = calibrate(engine, ids)
    assert len(sims) == N_LAYERS and all(-1.0 <= s <= 1.0 for s in sims)
    assert calibrate(engine, ids) == sims
    assert engine.length == 0 and engine.layer_hook is None  # left as found
    assert calibrate(engine, ids, chunk=32) != sims  # other passes, other contexts


@pytest.mark.slow
def test_calibration_runs_every_layer_and_restores_skip(synth):
    engine = cpu_engine(synth, ctx=64)
    engine.skip = {2}
    sims = calibrate(engine, PROMPT)
    assert engine.skip == {2} and len(sims) == N_LAYERS
    assert sims == calibrate(cpu_engine(synth, ctx=64), PROMPT)


@pytest.mark.slow
def test_an_identity_layer_has_similarity_one(identity_at_2):
    sims = calibrate(cpu_engine(identity_at_2, ctx=64), PROMPT)
    assert sims[2] == pytest.approx(1.0, abs=1e-6) and max(sims[1], sims[3]) < 0.9999


def test_the_shipped_calibration_text_is_prose():
    text = calibration_text()
    assert 300 <= len(text.split()) <= 1000 and text.isascii()


# --- choose ---------------------------------------------------------------------------------

SIMS = [0.10, 0.95, 0.99, 0.90, 0.97, 0.965, 0.999]


def test_choose_takes_the_top_k_never_the_first_or_last():
    assert choose(SIMS, k=1) == {2}
    assert choose(SIMS, k=2) == {2, 4}
    assert choose(SIMS, k=5) == {1, 2, 3, 4, 5}  # layer 6 (0.999) is the last: never
    assert choose(SIMS, k=0) == frozenset()
    with pytest.raises(ValueError, match="cannot skip 6 layers"):
        choose(SIMS, k=6)
    with pytest.raises(ValueError):
        choose(SIMS)


def test_choose_honours_a_threshold():
    assert choose(SIMS, threshold=0.96) == {2, 4, 5}
    assert choose(SIMS, threshold=0.96, k=2) == {2, 4}
    assert choose(SIMS, threshold=0.9999) == frozenset()
    assert choose([1.0, 1.0, 1.0], threshold=0.5) == {1}


def test_prefer_wins_among_near_equals_only():
    # distances from identity: layer 4 0.030, layer 5 0.035, layer 1 0.050
    assert choose(SIMS, k=2) == {2, 4}
    assert choose(SIMS, k=2, prefer={5}) == {2, 5}  # 0.035 / 1.25 = 0.028 < 0.030
    assert choose(SIMS, k=2, prefer={1}) == {2, 4}  # 0.050 / 1.25 = 0.040: too far
    assert choose(SIMS, k=2, prefer={5}, margin=0.1) == {2, 4}  # 0.0318: not near enough
    assert choose(SIMS, k=2, prefer={0, 6}) == {2, 4}  # never the first or last
    assert choose(SIMS, threshold=0.96, prefer={1}) == {2, 4, 5}  # no say over a threshold


# --- the engine -----------------------------------------------------------------------------


@pytest.mark.slow
def test_skipping_an_identity_layer_changes_no_bit(identity_at_2):
    full = _run(cpu_engine(identity_at_2, ctx=64))
    engine = cpu_engine(identity_at_2, ctx=64)
    engine.skip = {2}
    skipped = _run(engine)
    for a, b in zip(full, skipped):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_skipped_layer_is_never_acquired_and_its_cache_is_untouched(synth):
    engine = cpu_engine(synth, ctx=64)
    store = engine.layers
    asked = []
    acquire = store.acquire
    store.acquire = lambda i: asked.append(i) or acquire(i)
    engine.skip = {1, 4}
    out = _run(engine)
    assert set(asked) == {0, 2, 3, 5} and len(asked) == 4 * 5
    assert not engine.kv.k[1].any() and not engine.kv.v[4].any()
    assert not torch.equal(out[0], _run(cpu_engine(synth, ctx=64))[0])  # it did skip


@pytest.mark.slow
def test_setting_skip_resets_the_context_and_checks_the_layers(synth):
    engine = cpu_engine(synth, ctx=64)
    engine.forward(PROMPT)
    engine.skip = {3}
    assert engine.length == 0 and engine.skip == frozenset({3})
    with pytest.raises(ValueError, match="cannot skip layers"):
        engine.skip = {N_LAYERS}


# --- a streamed CPU model -------------------------------------------------------------------


@pytest.mark.slow
def test_a_streamed_model_never_reads_a_skipped_layer(synth, monkeypatch):
    # both at "exact", where every pass reads the GGUF spans this test follows (at "fast",
    # tests/memory/test_cpu_stream_packed.py follows the packed images' reads)
    resident = slipstream.load(synth, device="cpu", ctx=64, precision="exact")
    budget = resident.plan.fixed_bytes + 2 * max(resident.plan.file_bytes_per_layer) + 1
    streamed = slipstream.load(synth, device="cpu", ctx=64, precision="exact",
                               placement=slipstream.Placement(ram_budget=budget))
    assert streamed.plan.tiers == ["disk"] * N_LAYERS
    reads = []
    read_span = DirectReader.read_span
    monkeypatch.setattr(DirectReader, "read_span", lambda self, buf, start, end, *a, **k:
                        reads.append((start, end)) or read_span(self, buf, start, end, *a, **k))
    for model in (resident, streamed):
        model.engine.skip = {2, 3}
    reads.clear()  # from here on, what the skipped store asks the disk for
    want, got = _run(resident.engine), _run(streamed.engine)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    gf = GGUFFile(synth)
    skipped = [layer_span(gf, i) for i in (2, 3)]
    gf.close()
    assert reads and all(e <= s0 or s >= e0 for s, e in reads for s0, e0 in skipped)
    assert streamed.engine.layers.stats.layers_streamed == 4 * 5
    resident.close()
    streamed.close()


@pytest.mark.slow
def test_load_skip_layers_prefers_streamed_layers_among_near_equals(synth):
    model = slipstream.load(synth, device="cpu", ctx=64, skip_layers=2)
    assert len(model.skipped_layers) == 2 and model.skipped_layers == sorted(model.engine.skip)
    assert 0 not in model.skipped_layers and N_LAYERS - 1 not in model.skipped_layers
    sims = model.layer_similarities
    assert len(sims) == N_LAYERS
    assert set(model.skipped_layers) == choose(sims, k=2)  # all resident: no preference
    model.close()
    for bad in (-1, N_LAYERS - 1, 1.5):
        with pytest.raises(BadArgument, match="skip_layers"):
            slipstream.load(synth, device="cpu", ctx=64, skip_layers=bad)


# --- the CLI --------------------------------------------------------------------------------


@pytest.mark.slow
def test_perplexity_with_skipped_layers_through_the_cli(smollm_path):
    prose = Path(__file__).parents[1] / "data" / "prose.txt"
    r = subprocess.run([sys.executable, "-m", "slipstream.cli", "perplexity", "-m",
                        str(smollm_path), "-f", str(prose), "--ctx", "64", "--chunks", "1",
                        "--device", "cpu", "--skip-layers", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("perplexity ") and float(r.stdout.split()[1]) > 1.0
    line = next(x for x in r.stderr.splitlines() if x.startswith("skipping layers"))
    assert line.count("(0.") == 2  # two layers, each with its similarity
