"""CPU streaming at precision "fast": streamed layers decode from packed images written once at
load (memory.image_file.build_cpu_images, weights.cpu_image), as views into the staging buffer
they were read into, and prefill passes compute on the same views where the resident layer
prefills through its packed copies (packed prefill, the default), else rebuild the layer from
the GGUF file (a linear that prefills dense, or SLIPSTREAM_PACKED_PREFILL=0). Either way the
bits are the all-resident model's; and the image file is checked: a stale one is rebuilt, one
changed after it was written or while running fails with FileChanged, naming it."""

from __future__ import annotations

import os
import random
import shutil
import time

import pytest
import torch

import slipstream
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory import image_file
from slipstream.memory.disk import DiskReadError, FileChanged
from slipstream.memory.setup import PREFILL_STAGING
from slipstream.precision import Precision
from slipstream.runtime.build import injected_stream_delay
from slipstream.synth import write_synth
from slipstream.weights.cpu_image import image_nbytes
from slipstream.weights.linear import OnDemandDenseLinear

from helpers import cpu_budget

FAST = Precision.of("fast", torch.device("cpu"))
SHORT = [5, 77, 300, 12, 901, 44, 7, 8]  # 8 tokens: one pass through the packed decode path
LONG = SHORT + [3, 1000, 64, 2, 17]  # 13: a prefill pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed-stream")
    return write_synth(d / "tiny.gguf", "tiny", "Q4_K", n_layers=6, from_floats=True, std=0.08,
                       seed=11)


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny, path)
    return path


def budget_for(path, packed: int, whole: int = 0) -> int:
    """A RAM budget that keeps the images of the first `packed` layers in RAM at "fast" (the
    rest streamed), and where every layer is packed, the first `whole` ones whole."""
    return cpu_budget(path, packed, whole)


def greedy(model, prompt, n=10):
    return [e.id for e in model.generate(prompt, max_tokens=n, temperature=0)]


def test_the_plan_streams_packed_images_and_counts_their_buffers(tiny):
    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    images = [image_nbytes(gf, cfg, i, FAST) for i in range(6)]
    for (packed, whole), tiers in {(0, 0): ["disk"] * 6,
                                   (2, 0): ["packed"] * 2 + ["disk"] * 4,
                                   (6, 0): ["packed"] * 6,
                                   (6, 2): ["ram"] * 2 + ["packed"] * 4}.items():
        budget = budget_for(tiny, packed, whole)
        plan = slipstream.plan(tiny, device="cpu", ctx=64, measure=False,
                               placement=slipstream.Placement(ram_budget=budget))
        assert plan.tiers == tiers and plan.cpu_images
        assert plan.file_bytes_per_layer == images
        # a packed layer holds its image; a whole one its dense weights and packed copies
        for i, t in enumerate(tiers):
            if t != "ram":
                assert plan.resident_bytes_per_layer[i] == images[i]
        held = plan.fixed_bytes + plan.staging_buffers * max(images) + plan.prefill_staging + \
            sum(b for b, t in zip(plan.resident_bytes_per_layer, tiers) if t != "disk")
        assert held <= plan.budget
    # the largest packed layer being a little larger than the others, the budget of 2 packed
    # layers less a byte keeps one
    plan = slipstream.plan(tiny, device="cpu", ctx=64, measure=False,
                           placement=slipstream.Placement(ram_budget=budget_for(tiny, 2) - 2))
    assert plan.tiers == ["packed"] + ["disk"] * 5
    spans = [gf.tensors[n] for n in gf.tensors if n.startswith("blk.0.")]
    span = max(t.offset + t.n_bytes for t in spans) - min(t.offset for t in spans)
    assert plan.prefill_staging == PREFILL_STAGING * span
    exact = slipstream.plan(tiny, device="cpu", ctx=64, precision="exact", measure=False,
                            placement=slipstream.Placement(ram_budget=budget_for(tiny, 2)))
    assert not exact.cpu_images and exact.prefill_staging == 0
    assert set(exact.tiers) <= {"ram", "disk"}
    gf.close()


@pytest.mark.slow
@pytest.mark.parametrize("io", ["direct", "buffered", "mmap"])
@pytest.mark.parametrize("packed,whole", [(2, 0), (6, 1)])
def test_streamed_packed_layers_give_the_resident_bits(tiny_copy, io, packed, whole):
    resident = slipstream.load(tiny_copy, device="cpu", ctx=64)
    budget = budget_for(tiny_copy, packed, whole)
    streamed = slipstream.load(tiny_copy, device="cpu", ctx=64,
                               placement=slipstream.Placement(ram_budget=budget, io=io))
    assert streamed.plan.tiers.count("packed") == packed - whole
    assert streamed.plan.tiers.count("disk") == 6 - packed
    written = sorted(tiny_copy.parent.glob(f"{tiny_copy.name}.slipstream-cpu.*.img"))
    # written only for layers that stream from disk, named by them
    assert written == ([image_file.image_paths(tiny_copy, "slipstream-cpu",
                                               layers=streamed.plan.disk_layers)[0]]
                       if packed < 6 else [])
    for prompt in (SHORT, LONG):  # the decode pass and the prefill one
        assert torch.equal(resident.logits(prompt), streamed.logits(prompt))
        assert greedy(resident, prompt) == greedy(streamed, prompt)
    # passes of both kinds alternating, on one context
    for model in (resident, streamed):
        model.engine.reset()
    for n in (11, 1, 9, 1, 1, 12, 2):
        ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))
        assert torch.equal(resident.engine.forward(ids), streamed.engine.forward(ids)), n
    # Q4_K layers prefill from their images: "packed" layers (in RAM) read nothing at all
    assert (streamed.engine.layers.stats.layers_streamed > 0) == (packed < 6)
    resident.close()
    streamed.close()


def _assert_views(store, i: int) -> None:
    """Layer i, acquired, is views into the staging buffer its image was read into."""
    layer = store.acquire(i)
    buf = store._held[i]
    base = buf.tensor.data_ptr()
    gate_up = layer.ffn_gate_up.packed  # q4vnni: one plane; int4pack: codes and scale_zeros
    for w in (layer.ffn_down.packed.packed, getattr(gate_up, "scale_zeros", gate_up.packed),
              layer.attn_norm):
        assert base <= w.data_ptr() < base + buf.nbytes  # a view, not a copy
    store.release(i)


# (quant mix, SLIPSTREAM_PACKED_PREFILL, Q6_K's q6vnni off) -> whether the streamed layers
# prefill from their images: Q4_K_M's q/k/v are held as parts (q4vnni q and k, q6vnni v:
# PartsLinear) beside q4vnni and q6vnni; without q6vnni (a CPU without its VNNI loop) Q6_K
# takes torch's int8pack, which prefills through a dense weight the image lacks, as cb4
# (IQ4_XS) does: those layers are rebuilt from the GGUF file with their packed copies made for
# the linears that prefill packed
SOURCES = {("Q4_K", "1", False): True, ("Q4_K", "0", False): False,
           ("Q4_K_M", "1", False): True, ("Q4_K_M", "1", True): False,
           ("IQ4_XS", "1", False): False}


@pytest.mark.parametrize("mix,packed_prefill,no_q6vnni", [
    pytest.param(*case, marks=() if case == ("Q4_K_M", "1", True) else pytest.mark.slow)
    for case in SOURCES])
def test_streamed_prefill_gives_the_resident_bits_from_either_source(
        tmp_path, monkeypatch, mix, packed_prefill, no_q6vnni):
    from slipstream.weights.cpu import PackedDecodeLinear, kinds

    if mix == "Q4_K_M" and kinds.kind_for(14) != "q6vnni":
        pytest.skip("no q6vnni here: Q4_K_M's layers mix layouts whatever the test says")
    if mix == "IQ4_XS" and kinds.kind_for(23) != "cb4":
        pytest.skip("no cb4 here (native library)")
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", packed_prefill)
    if no_q6vnni:
        monkeypatch.setattr(kinds, "q6vnni_available", lambda: False)
    path = write_synth(tmp_path / "m.gguf", "tiny", mix, n_layers=3, from_floats=True,
                       std=0.08, seed=11)
    resident = slipstream.load(path, device="cpu", ctx=64)
    streamed = slipstream.load(path, device="cpu", ctx=64,
                               placement=slipstream.Placement(ram_budget=budget_for(path, 1)))
    store = streamed.engine.layers
    assert streamed.plan.tiers == ["packed"] + ["disk"] * 2
    assert store.image_prefill == (frozenset(range(3)) if SOURCES[mix, packed_prefill,
                                                                    no_q6vnni] else frozenset())
    for prompt in (LONG, SHORT):
        assert torch.equal(resident.logits(prompt), streamed.logits(prompt)), prompt
    if not store.image_prefill and packed_prefill == "1":
        # rebuilt from the GGUF file as the resident layer is built
        store.begin_pass(len(LONG))
        layer, ref = store.acquire(2), resident.engine.weights.layers[2]
        for name in ("attn_output", "ffn_gate_up", "ffn_down"):
            lin, want = getattr(layer, name), getattr(ref, name)
            assert isinstance(lin, PackedDecodeLinear) == isinstance(want, PackedDecodeLinear)
            assert getattr(lin, "packed_prefill", False) == \
                getattr(want, "packed_prefill", False), name
        store.release(2)
    resident.close()
    streamed.close()


@pytest.mark.slow
@pytest.mark.parametrize("packed_prefill", ["1", "0"])
def test_decode_layers_are_views_into_the_staging_buffers(tiny_copy, monkeypatch,
                                                          packed_prefill):
    """A decode pass reads the images, not the GGUF file, and makes no dense weights. So
    does a prefill pass with packed prefill (the GGUF file is then never read, and the store
    keeps no ring for it); without it, a prefill pass reads the GGUF file alone."""
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", packed_prefill)
    on = packed_prefill == "1"
    model = slipstream.load(tiny_copy, device="cpu", ctx=64,
                            placement=slipstream.Placement(ram_budget=budget_for(tiny_copy, 2)))
    store = model.engine.layers
    assert model.plan.tiers == ["packed"] * 2 + ["disk"] * 4
    assert store.image_prefill == (frozenset(range(6)) if on else frozenset())
    assert (store.staging is None) == on
    greedy(model, SHORT, 2)
    image_reads = store.decode_staging.reader.bytes_read
    store.begin_pass(1)
    _assert_views(store, 3)
    assert store.acquire(1) is store.acquire(1)  # a packed layer: made once, in RAM
    store.release(1)
    greedy(model, SHORT, 4)
    assert store.decode_staging.reader.bytes_read > image_reads
    image_reads = store.decode_staging.reader.bytes_read
    gguf_reads = store.staging.reader.bytes_read if not on else 0
    store.begin_pass(len(LONG))  # a prefill pass
    if on:
        _assert_views(store, 3)
        assert store.acquire(1) is store.packed[1]
    else:
        assert store.acquire(3).ffn_down.weight.dtype == torch.float16  # rebuilt dense
        assert store.acquire(1) is not store.packed[1]
    store.release(1)
    store.release(3)
    model.logits(LONG)  # one prefill pass
    if on:
        assert store.decode_staging.reader.bytes_read > image_reads
    else:  # (the image ring may read ahead meanwhile: no check of it)
        assert store.staging.reader.bytes_read > gguf_reads
    model.close()


@pytest.mark.slow
def test_streamed_packed_under_random_reader_delays(tiny_copy):
    resident = slipstream.load(tiny_copy, device="cpu", ctx=64)
    rng = random.Random(3)
    budget = budget_for(tiny_copy, 0)
    with injected_stream_delay(lambda: time.sleep(rng.random() / 50)):
        streamed = slipstream.load(tiny_copy, device="cpu", ctx=64,
                                   placement=slipstream.Placement(ram_budget=budget))
    assert streamed.plan.tiers == ["disk"] * 6
    assert greedy(resident, LONG, 12) == greedy(streamed, LONG, 12)
    assert greedy(resident, SHORT, 12) == greedy(streamed, SHORT, 12)


@pytest.mark.slow
@pytest.mark.parametrize("packed_prefill", ["1", "0"])
def test_real_model_streamed_packed_equals_resident(smollm_path, monkeypatch, packed_prefill):
    """The default model (Q4_1: q4vnni, its head Q6_K) with packed prefill, whose streamed
    layers prefill from their images, and without it (SLIPSTREAM_PACKED_PREFILL=0: rebuilt
    dense from the GGUF file, as resident layers then prefill dense)."""
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", packed_prefill)
    resident = slipstream.load(smollm_path, device="cpu", ctx=128)
    budget = cpu_budget(smollm_path, packed=20, ctx=128)
    streamed = slipstream.load(smollm_path, device="cpu", ctx=128,
                               placement=slipstream.Placement(ram_budget=budget))
    assert streamed.plan.tiers == ["packed"] * 20 + ["disk"] * 10
    assert streamed.engine.layers.image_prefill == \
        (frozenset(range(30)) if packed_prefill == "1" else frozenset())
    # the head holds its GGUF bytes: an all-logits pass of more than 8 rows dequantizes it
    assert streamed.plan.head_dense_on_demand
    assert isinstance(streamed.engine.weights.output.dense, OnDemandDenseLinear)
    ids = resident.tokenize("Streaming must not change a single bit:")
    assert len(ids) > 8  # a dense prefill pass, then packed decode passes
    assert torch.equal(resident.logits(ids), streamed.logits(ids))
    assert torch.equal(resident.logits(ids[:5]), streamed.logits(ids[:5]))
    a = [e.id for e in resident.generate(ids, max_tokens=8, temperature=0)]
    b = [e.id for e in streamed.generate(ids, max_tokens=8, temperature=0)]
    assert a == b


@pytest.mark.slow
def test_a_skipped_layer_is_read_from_neither_file(tiny_copy, monkeypatch):
    from slipstream.memory.disk import DirectReader
    from slipstream.weights.loader import layer_span

    resident = slipstream.load(tiny_copy, device="cpu", ctx=64)
    streamed = slipstream.load(tiny_copy, device="cpu", ctx=64,
                               placement=slipstream.Placement(ram_budget=budget_for(tiny_copy, 1)))
    assert streamed.plan.tiers == ["packed"] + ["disk"] * 5
    reads = []
    read_span = DirectReader.read_span
    monkeypatch.setattr(DirectReader, "read_span", lambda self, buf, start, end, *a, **k:
                        reads.append((self.path, start, end)) or
                        read_span(self, buf, start, end, *a, **k))
    for model in (resident, streamed):
        model.engine.skip = {2, 3}
    reads.clear()
    for prompt in (SHORT, LONG):
        assert greedy(resident, prompt, 4) == greedy(streamed, prompt, 4)
    images = streamed.engine.layers.images
    skipped = {(images.path, *images.spans[i]) for i in (2, 3)}
    skipped |= {(tiny_copy, *layer_span(streamed.gguf, i)) for i in (2, 3)}
    # packed prefill: the images serve prefill passes too, the GGUF file is not read
    assert {p for p, _, _ in reads} == {images.path}
    assert not skipped & set(reads)
    resident.close()
    streamed.close()


# --- the image file ---------------------------------------------------------------------

def _images(path, layers):
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    sizes = [image_nbytes(gf, cfg, i, FAST) for i in range(cfg.n_layers)]
    imgs = image_file.build_cpu_images(gf, cfg, FAST, layers, sizes, progress=False)
    gf.close()
    return imgs


@pytest.mark.slow
def test_the_image_file_is_reused_while_current_and_rebuilt_when_stale(tiny_copy):
    imgs = _images(tiny_copy, [3, 4, 5])
    assert imgs.path.parent == tiny_copy.parent and imgs.path.stat().st_size % 4096 == 0
    assert all(s % 4096 == 0 for s, _ in imgs.spans.values())
    assert set(imgs.fingerprints) == {3, 4, 5}
    assert image_file.open_cpu_images(tiny_copy, [3, 4, 5]) is not None
    assert image_file.open_cpu_images(tiny_copy, [4, 5]) is None  # another plan's file
    # the image file changed after it was written (truncated; rewritten): not reused
    st = imgs.path.stat()
    with open(imgs.path, "r+b") as f:
        f.truncate(st.st_size - 4096)
    assert image_file.open_cpu_images(tiny_copy, [3, 4, 5]) is None
    imgs = _images(tiny_copy, [3, 4, 5])  # rebuilt
    os.utime(imgs.path, ns=(time.time_ns(), imgs.path.stat().st_mtime_ns + 10**9))
    assert image_file.open_cpu_images(tiny_copy, [3, 4, 5]) is None
    imgs = _images(tiny_copy, [3, 4, 5])
    # the model changed: rebuild
    os.utime(tiny_copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert image_file.open_cpu_images(tiny_copy, [3, 4, 5]) is None


@pytest.mark.slow
def test_an_image_changed_after_it_was_written_fails_its_first_read(tiny_copy):
    """Rewritten in place with its size and modification time kept: the index's identity
    check cannot see it, the sampled checksums written with it do."""
    budget = budget_for(tiny_copy, 0)
    slipstream.load(tiny_copy, device="cpu", ctx=64,
                    placement=slipstream.Placement(ram_budget=budget)).close()  # writes it
    data, _ = image_file.image_paths(tiny_copy, "slipstream-cpu", layers=range(6))
    st = data.stat()
    with open(data, "r+b") as f:
        raw = bytearray(f.read())
        for k in range(len(raw)):
            raw[k] ^= 0x5A
        f.seek(0)
        f.write(raw)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    model = slipstream.load(tiny_copy, device="cpu", ctx=64,
                            placement=slipstream.Placement(ram_budget=budget))
    with pytest.raises(FileChanged, match=f"{data}.* differ from what was written there"):
        greedy(model, SHORT, 2)
    model.close()


@pytest.mark.slow
@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_an_image_truncated_mid_run_is_a_clear_error(tiny_copy, io):
    model = slipstream.load(tiny_copy, device="cpu", ctx=64,
                            placement=slipstream.Placement(ram_budget=budget_for(tiny_copy, 0),
                                                           io=io))
    greedy(model, SHORT, 2)
    data, _ = image_file.image_paths(tiny_copy, "slipstream-cpu", layers=range(6))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(DiskReadError, match=f"{data.name}.*truncated or replaced while running"):
        greedy(model, SHORT, 2)
    model.close()
