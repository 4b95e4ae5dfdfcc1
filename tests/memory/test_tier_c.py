"""CUDA tier C logic that runs without CUDA: the planner's three tiers on a fake CUDA budget,
the computed VRAM sizes against real packing, the image file, the staging ring's reuse rule
(with fake copy events), its error paths, and the kvikio dependency error."""

from __future__ import annotations

import errno
import os
import random
import sys
import threading
import time

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

import slipstream
from slipstream.modelfile.config import ModelConfig
from slipstream.errors import BudgetTooSmall, MissingDependency
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.kernels.pack import SUPPORTED, pack_weight
from slipstream.memory import image_file
from slipstream.memory.disk import DirectReader, DiskReadError
from slipstream.memory.planner import plan_cuda
from slipstream.memory.staging import StagingBuffer, StagingRing
from slipstream.memory.store import StoreStats, StreamDelays
from slipstream.memory.vram import (layer_flat_bytes, layer_image_bytes, layer_vram_bytes,
                                   packed_planes, vram_reserve)
from slipstream.precision import Precision
from slipstream.runtime.engine import GRAPH_BUCKET, PREFILL_CHUNK
from slipstream.synth import write_synth

GiB = 2**30
FAST_CPU = Precision.of("fast", torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tierc")
    return write_synth(d / "tiny.gguf", "tiny", "Q4_K_M", n_layers=6, from_floats=True,
                       std=0.08, seed=3)


def _open(path):
    gf = GGUFFile(path)
    return gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)


# --- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qt", SUPPORTED, ids=lambda q: q.name)
def test_packed_planes_match_pack_weight(qt):
    rows, cols = 17, 512
    block, size = GGML_QUANT_SIZES[qt]
    n = rows * cols // block * size
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    if qt in (T.F16, T.BF16, T.F32):
        raw.zero_()  # any bytes are fine; zeros avoid NaN patterns
    p = pack_weight(raw, qt, rows, cols)
    got = sorted(t.numel() * t.element_size() for t in (p.lo, p.hi, p.d, p.m, p.sc, p.mn)
                 if t is not None)
    assert got == sorted(packed_planes(qt, rows, cols))


@pytest.fixture(scope="module")
def kernel_builder(tiny):
    """A LayerBuilder that packs for the kernels on the CPU (QuantLinear only looks the Triton
    kernels up; it never runs them here)."""
    pytest.importorskip("triton")
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder

    _, cfg = _open(tiny)
    b = LayerBuilder(cfg, torch.device("cpu"), FAST_CPU, workspace=Workspace(
        torch.device("cpu")))
    b.quantized = True
    return b


def test_image_bytes_predicted_exactly(tiny, kernel_builder):
    from slipstream.weights.image import to_image
    from slipstream.weights.loader import TensorSource

    gf, cfg = _open(tiny)
    for i in range(cfg.n_layers):
        image = to_image(kernel_builder.build(TensorSource(gf), i), pin=False)
        assert image.nbytes == layer_image_bytes(gf, cfg, i)
        assert layer_vram_bytes(gf, cfg, i) >= image.nbytes * 0.9


def test_vram_reserve_parts(tiny):
    gf, cfg = _open(tiny)
    r = vram_reserve(gf, cfg, ctx=256, kv_bytes_per_elem=2, chunk=2048, graphs=True,
                     graph_bucket=GRAPH_BUCKET)
    assert r["KV cache"] == 2 * cfg.n_layers * cfg.n_kv_heads * 256 * cfg.head_dim * 2
    assert r["prefill workspace"] >= 2 * cfg.vocab_size * cfg.hidden  # head = largest here
    assert r["CUDA graph pools"] > 0
    r2 = vram_reserve(gf, cfg, ctx=512, kv_bytes_per_elem=2, chunk=2048, graphs=False,
                      graph_bucket=GRAPH_BUCKET)
    assert r2["KV cache"] == 2 * r["KV cache"] and r2["CUDA graph pools"] == 0
    assert r2["embedding"] >= gf.tensors["token_embd.weight"].n_bytes
    r3 = vram_reserve(gf, cfg, ctx=512, kv_bytes_per_elem=2, chunk=2048, graphs=False,
                      embed_on_host=True, graph_bucket=GRAPH_BUCKET)
    assert r3["embedding"] == 0 and r3["head"] == r2["head"]


def test_prefill_workspace_is_the_largest_layer_weight_not_the_head(tmp_path):
    """With a vocabulary 8x the largest layer weight, the scratch stays the layer's size (the
    head is multiplied in row chunks: weights.linear.Workspace)."""
    from dataclasses import replace

    from slipstream.synth import SHAPES
    from slipstream.weights.loader import prefill_scratch_elements

    path = write_synth(tmp_path / "wide.gguf", replace(SHAPES["tiny"], vocab=8192), "Q4_K",
                       n_layers=1)
    gf, cfg = _open(path)
    r = vram_reserve(gf, cfg, ctx=64, kv_bytes_per_elem=2, chunk=64, graphs=False,
                     graph_bucket=GRAPH_BUCKET)
    assert r["prefill workspace"] == 2 * prefill_scratch_elements(cfg) == 2 * 2 * 512 * 256
    assert r["prefill workspace"] * 8 <= 2 * cfg.vocab_size * cfg.hidden


# --- the planner on a fake CUDA budget -------------------------------------------------------

def test_plan_cuda_three_tiers():
    vram, image = [100] * 10, [90] * 10
    reserve = {"KV cache": 50, "activations": 50}
    # VRAM: 100 reserve + 2 slots of 90 + 3 layers; RAM: 3 staging of 90 + 2 images
    plan = plan_cuda(vram, image, reserve, 100 + 180 + 300 + 5, 270 + 180 + 5, n_slots=2,
                     n_staging=3)
    # the 7 streamed layers spread between the 3 in VRAM; the first 2 of them pinned
    assert plan.tiers == ["pinned", "pinned", "vram", "disk", "disk", "vram", "disk", "disk",
                          "vram", "disk"]
    assert plan.host_staging == 3 and plan.bytes_per_token("disk") == 450
    assert plan.bytes_per_token("pinned") == 180
    plan.bandwidth_gbps.update(vram=1000.0, pinned=50.0, disk=2.0)
    # resident compute, then the slower of the copy link (630 B) and the disk (450 B)
    seconds = 300 / 1000e9 + max(630 / 50e9, 450 / 2e9)
    assert plan.predicted_tok_s == pytest.approx(1 / seconds)
    from rich.console import Console

    text = Console(width=200, record=True).print(plan.table()) or ""
    assert text == ""  # renders without error


def test_plan_cuda_budget_errors_name_the_minimum():
    vram, image = [100] * 4, [90] * 4
    with pytest.raises(BudgetTooSmall, match=r"needs at least 280 B .*KV cache 100 B"):
        plan_cuda(vram, image, {"KV cache": 100}, 200, None)
    with pytest.raises(BudgetTooSmall, match=r"3 pinned staging buffers alone take 270 B"):
        plan_cuda(vram, image, {"KV cache": 100}, 300, 100)
    # kvikio and mmap bring their own staging: no pinned buffers asked for
    plan = plan_cuda(vram, image, {"KV cache": 100}, 300, 100, io="kvikio")
    assert plan.host_staging == 0 and plan.tiers.count("disk") == 3
    # the mmap baseline's own slot comes out of the VRAM room
    assert plan_cuda(vram, image, {}, 180 + 100, None).tiers.count("vram") == 1
    assert plan_cuda(vram, image, {}, 180 + 100, None, io="mmap").tiers.count("vram") == 0


def test_plan_for_cuda_on_a_fake_device(tiny, monkeypatch):
    """The whole CUDA planning path, with torch.cuda.mem_get_info faked: small budgets put
    the streamed layers past the RAM budget on disk, and the VRAM budget is capped by what is
    free."""
    from slipstream.memory.setup import plan_for

    gf, cfg = _open(tiny)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB, 141 * GiB))
    dev = torch.device("cuda")
    fast = Precision.of("fast", dev)
    engine = dict(prefill_chunk=PREFILL_CHUNK, graph_bucket=GRAPH_BUCKET)
    full = plan_for(gf, cfg, dev, fast, 256, None, None, **engine)
    assert full.tiers == ["vram"] * 6 and full.budget == 80 * GiB
    # graphs are off when layers stream, so the streamed plan's reserve has no graph pools,
    # and the embedding stays on the host
    # and it leaves the allocator a slack (memory.setup.STREAMED_SLACK_LAYERS)
    from helpers import streamed_slack

    fixed = (full.fixed_bytes - full.reserve["CUDA graph pools"] - full.reserve["embedding"]
             + streamed_slack(full))
    slot = max(full.file_bytes_per_layer)
    vram = fixed + 2 * slot + layer_flat_bytes(gf, cfg, 4) + 1  # one layer, in one buffer
    ram = 3 * slot + slot + 1  # the staging buffers and one pinned layer
    plan = plan_for(gf, cfg, dev, fast, 256, ram, vram, **engine)
    assert plan.tiers == ["pinned", "disk", "disk", "disk", "vram", "disk"]
    assert plan.reserve["KV cache"] > 0 and not plan.graphs and plan.embed_on_host
    assert plan.reserve["embedding"] == 0
    assert "CUDA graph pools" in plan.reserve and plan.reserve["CUDA graph pools"] == 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (vram // 2, 141 * GiB))
    with pytest.raises(BudgetTooSmall, match="VRAM budget cannot run this model on cuda"):
        plan_for(gf, cfg, dev, fast, 256, ram, vram, **engine)


# --- the image file ---------------------------------------------------------------------

def test_image_file_round_trip_and_reuse(tiny, tmp_path, kernel_builder):
    import shutil

    from slipstream.weights.image import _tensors, from_image, to_image
    from slipstream.weights.loader import TensorSource

    path = tmp_path / "m.gguf"
    shutil.copy(tiny, path)
    gf, cfg = _open(path)
    sizes = [layer_image_bytes(gf, cfg, i) for i in range(cfg.n_layers)]
    imgs = image_file.build_images(gf, cfg, torch.device("cpu"), FAST_CPU, [3, 4, 5],
                                   sizes, progress=False, builder=kernel_builder)
    assert imgs.path.parent == tmp_path and imgs.path.stat().st_size % 4096 == 0
    reader = DirectReader(imgs.path, io="direct")
    bufs = [StagingBuffer(max(sizes) + 4096, pinned=False) for _ in range(2)]
    ring = StagingRing(reader, bufs, [3, 4, 5], imgs.spans)
    try:
        for _ in range(2):  # twice round the ring
            for i in (3, 4, 5):
                buf, skew = ring.take(i)
                start, end = imgs.spans[i]
                slot = buf.tensor[skew:skew + end - start].clone()
                ring.give_back(buf, None)
                got = from_image(imgs.layouts[i], slot, kernel_builder.workspace)
                built = kernel_builder.build(TensorSource(gf), i)
                assert torch.equal(slot, to_image(built, pin=False).host)
                want = dict(_tensors(built))
                for key, t in _tensors(got):  # every plane, as views into the slot
                    assert torch.equal(t, want.pop(key)), key
                assert not want
    finally:
        ring.close()
    # reused while the model is unchanged and holds the layers asked for
    assert image_file.open_images(path, [3, 4, 5]) is not None
    assert image_file.open_images(path, [4, 5]) is None  # another plan's file
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert image_file.open_images(path, [3, 4, 5]) is None  # the model changed: rebuild


def test_image_file_needs_disk_space(tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    path = tmp_path / "m.gguf"
    shutil.copy(tiny, path)
    gf, cfg = _open(path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda d: usage(10 * GiB, 10 * GiB, 100))
    with pytest.raises(BudgetTooSmall, match="repacked layer images .* only 100 B is free"):
        image_file.build_images(gf, cfg, torch.device("cpu"), FAST_CPU, [5],
                                [10 << 20] * 6, progress=False)


def test_layout_json_round_trip(tiny, kernel_builder):
    import json

    from slipstream.weights.image import LayerLayout, to_image
    from slipstream.weights.loader import TensorSource

    gf, _ = _open(tiny)
    layout = to_image(kernel_builder.build(TensorSource(gf), 0), pin=False).layout
    back = LayerLayout.from_json(json.loads(json.dumps(layout.to_json())))
    assert back == layout


# --- the staging ring's reuse rule ------------------------------------------------------------

class FakeCopy:
    """A host-to-device copy that takes a while, in a thread; `synchronize` waits for it, like
    the CUDA event the store records after the copy. It checks that the buffer it copies from
    still holds what it held when the copy was enqueued, all the way to its end."""

    violations: list[str] = []

    def __init__(self, buf: StagingBuffer, skew: int, n: int, seconds: float):
        self.done = threading.Event()
        self.want = bytes(buf.view[skew:skew + n])
        self.buf, self.skew, self.n = buf, skew, n
        threading.Thread(target=self._run, args=(seconds,), daemon=True).start()

    def _run(self, seconds: float) -> None:
        time.sleep(seconds)
        if bytes(self.buf.view[self.skew:self.skew + self.n]) != self.want:
            FakeCopy.violations.append("a read refilled a buffer while its copy ran")
        self.done.set()

    def synchronize(self) -> None:
        self.done.wait()


class NoWait(FakeCopy):
    """The reference engine's bug: the buffer counts as free as soon as the copy is queued."""

    def synchronize(self) -> None:
        pass


def _layers_file(tmp_path, n_layers=5, size=3 * 4096):
    path = tmp_path / "layers.bin"
    rng = random.Random(0)
    data = bytes(rng.randrange(256) for _ in range(n_layers * size))
    path.write_bytes(data)
    spans = {i: (i * size, (i + 1) * size) for i in range(n_layers)}
    return path, data, spans


def _run_ring(tmp_path, event_cls, tokens=6, reader_delay=None, seed=0):
    path, data, spans = _layers_file(tmp_path)
    rng = random.Random(seed)
    reader = DirectReader(path, threads=2, io="buffered", delay=reader_delay)
    bufs = [StagingBuffer(4 * 4096, pinned=False) for _ in range(3)]
    ring = StagingRing(reader, bufs, list(spans), spans, timeout_s=10)
    FakeCopy.violations = []
    copies = []
    try:
        for _ in range(tokens):
            for i, (s, e) in spans.items():
                buf, skew = ring.take(i)
                assert bytes(buf.view[skew:skew + e - s]) == data[s:e]
                copy = event_cls(buf, skew, e - s, rng.random() / 100)
                copies.append(copy)
                ring.give_back(buf, copy)
        for c in copies:
            c.done.wait()
    finally:
        ring.close()
    return FakeCopy.violations


def test_staging_buffer_is_not_refilled_before_its_copy_completes(tmp_path):
    rng = random.Random(1)
    assert _run_ring(tmp_path, FakeCopy, reader_delay=lambda: time.sleep(rng.random() / 200)) \
        == []


def test_the_reuse_check_catches_the_reference_race(tmp_path):
    """Negative control: without the wait, reads land in buffers still being copied."""
    assert _run_ring(tmp_path, NoWait)


def test_reader_error_surfaces_in_the_main_thread(tmp_path):
    path, _, spans = _layers_file(tmp_path)

    def fail():
        raise OSError(errno.EIO, "Input/output error")

    reader = DirectReader(path, io="buffered", delay=fail)
    ring = StagingRing(reader, [StagingBuffer(4 * 4096, pinned=False)], list(spans), spans)
    with pytest.raises(DiskReadError, match="Input/output error"):
        ring.take(0)
    ring.close()


def test_a_stalled_disk_times_out_instead_of_hanging(tmp_path):
    path, _, spans = _layers_file(tmp_path)
    release = threading.Event()
    reader = DirectReader(path, io="buffered", delay=lambda: release.wait(10))
    ring = StagingRing(reader, [StagingBuffer(4 * 4096, pinned=False)], list(spans), spans,
                       timeout_s=0.2)
    t0 = time.perf_counter()
    with pytest.raises(DiskReadError, match="did not finish in 0 s; the disk stalled"):
        ring.take(0)
    assert time.perf_counter() - t0 < 5
    release.set()
    ring.close()


def test_truncated_file_is_a_clear_error(tmp_path):
    path, _, spans = _layers_file(tmp_path)
    reader = DirectReader(path, io="buffered")
    ring = StagingRing(reader, [StagingBuffer(4 * 4096, pinned=False)], list(spans), spans)
    ring.give_back(ring.take(0)[0], None)
    os.truncate(path, 4096)
    with pytest.raises(DiskReadError, match="truncated or replaced"):
        for i in list(spans)[1:]:
            buf, _ = ring.take(i)
            ring.give_back(buf, None)
    ring.close()


# --- small pieces -----------------------------------------------------------------------------

def test_stream_delays_short_forms():
    f = lambda: None  # noqa: E731
    assert StreamDelays.of(f).reader is f and StreamDelays.of(5).copy_cycles == 5
    assert StreamDelays.of(None) == StreamDelays()
    d = StreamDelays(f, 7)
    assert StreamDelays.of(d) is d


def test_kvikio_missing_is_a_clear_error(monkeypatch):
    from slipstream.memory.setup import check_io

    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio raises ImportError
    with pytest.raises(MissingDependency, match=r"pip install kvikio-cu12 .* kvikio-cu13"):
        check_io("kvikio", torch.device("cuda"))


def test_cli_kvikio_on_cpu_is_one_line(tiny, capsys):
    from slipstream.cli import main

    assert main(["run", "-m", str(tiny), "--device", "cpu", "--io", "kvikio", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--device cuda" in err and "\n" not in err


def test_gpu_slots_below_two_is_a_clear_error(tiny, capsys):
    from slipstream.cli import main
    from slipstream.errors import BadArgument

    with pytest.raises(BadArgument, match="gpu_slots=1 is invalid"):
        slipstream.load(tiny, device="cpu", placement=slipstream.Placement(gpu_slots=1))
    assert main(["run", "-m", str(tiny), "--device", "cpu", "--gpu-slots", "0", "-n", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "at least 2 GPU slots" in err and "\n" not in err


def test_plan_cuda_takes_k_slots():
    """K slots of the largest image come out of the VRAM budget before any layer."""
    vram, image = [100] * 6, [90] * 6
    reserve = {"KV cache": 100}
    for k in (2, 3, 4):
        plan = plan_cuda(vram, image, reserve, 100 + k * 90 + 200 + 5, None, n_slots=k)
        assert plan.staging_buffers == k
        assert plan.tiers == ["pinned", "vram", "pinned", "pinned", "vram", "pinned"]


def test_breakdown_table_on_cuda_stats():
    from rich.console import Console

    from slipstream.cli import breakdown_table
    from slipstream.runtime.generate import GenerationStats

    s = GenerationStats(prompt_tokens=8, generated_tokens=4, prefill_s=0.5, decode_s=1.5)
    st = StoreStats(disk_wait_s=0.4, disk_bytes=4 << 30, h2d_bytes=8 << 30, compute_s=0.2,
                    stall_s=1.1, h2d_s=0.3, disk_read_s=1.7, layers_streamed=40)
    c = Console(width=160, record=True)
    c.print(breakdown_table(s, st, "cuda"))
    out = c.export_text()
    for part in ("compute", "stall", "disk wait", "host-to-device", "disk reads"):
        assert part in out
    assert "28.6" in out  # 8 GiB in 0.3 s


def test_plan_table_collapses_interleaved_layer_lists():
    from slipstream.memory.planner import _interleave, _ranges

    assert _ranges([0, 1, 2, 3]) == "0-3" and _ranges([5]) == "5" and _ranges([1, 3]) == "1, 3"
    assert _ranges([1, 3, 5, 9, 10, 11]) == "1-5 step 2, 9-11"
    tiers = _interleave([10] * 80, 370)  # 37 of 80 in VRAM, none of them adjacent
    vram = [i for i, t in enumerate(tiers) if t == "vram"]
    assert len(vram) == 37 and all(b - a >= 2 for a, b in zip(vram, vram[1:]))
    assert tiers[-1] == "pinned"


def test_plan_cpu_prediction_counts_the_rebuild_of_streamed_layers():
    """CPU tier C rebuilds (dequantizes) every streamed layer on every token, which took 76 %
    of a token's time: the prediction counts it with every layer's compute and the head, and
    says it cannot predict without the rates (tests/memory/test_cpu_predict.py has more)."""
    from rich.console import Console

    from slipstream.memory.planner import plan_layers

    plan = plan_layers("cpu", [100] * 4, [40] * 4, fixed_bytes=10, budget=10 + 2 * 100 + 80)
    assert plan.tiers == ["ram", "ram", "disk", "disk"]
    plan.bandwidth_gbps.update(ram=10.0, disk=1.0, compute=4.0)
    assert plan.predicted_tok_s is None  # the rebuild not measured
    plan.bandwidth_gbps["rebuild"] = 0.5
    seconds = 400 / 4e9 + 80 / 0.5e9  # every layer computes; the reads overlap
    assert plan.predicted_tok_s == pytest.approx(1 / seconds)
    console = Console(width=200, record=True)
    console.print(plan.table())
    assert "rebuild" in console.export_text()
