"""`slipstream bench`'s roofline on every plan: what one decode token moves over each link
(runtime.bench.decode_traffic), from the tier plan and the layers the engine built. CUDA plans
(streamed, hybrid) are built here as plan objects around a CPU engine's layers, as their
stores leave streamed layers unbuilt (None); the CPU plans are real."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from helpers import cpu_engine
from slipstream.hybrid.plan import HybridPlan
from slipstream.memory.planner import Plan
from slipstream.runtime.bench import _layer_bytes, decode_traffic, weight_bytes_per_token
from slipstream.synth import write_synth


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_synth(tmp_path_factory.mktemp("traffic") / "m.gguf", "tiny", "Q8_0",
                       n_layers=4)
    return cpu_engine(path, ctx=32)


def streamed_engine(engine, resident: set[int]):
    """The engine as a streamed store leaves it: layers outside `resident` are None."""
    w = engine.weights
    layers = [layer if i in resident else None for i, layer in enumerate(w.layers)]
    return SimpleNamespace(weights=dataclasses.replace(w, layers=layers), skip=set())


def cuda_plan(tiers: list[str], image: int, **kw) -> Plan:
    return Plan(device="cuda", tiers=tiers, resident_bytes_per_layer=[image] * len(tiers),
                file_bytes_per_layer=[image] * len(tiers), fixed_bytes=0, budget=None,
                staging_buffers=2, bandwidth_gbps={"pinned": 25.0, "disk": 5.0}, **kw)


def test_an_all_resident_plan_reads_its_weights_from_memory(engine):
    t = decode_traffic(engine, None, memory_gbps=10.0)
    assert t.links() == {"memory": weight_bytes_per_token(engine)}
    assert t.roofline_tok_s == pytest.approx(10e9 / t.memory)
    assert t.bound_by() == "memory"


def test_a_streamed_cuda_plan_counts_pcie_and_disk(engine):
    """The crash this replaces: streamed layers are None in the engine's weights. Layer 0 in
    VRAM, 1-2 pinned, 3 on disk: every streamed image crosses PCIe, the disk one is read
    first, and the GPU reads all of them from their slots."""
    image = 3_000_000
    eng = streamed_engine(engine, {0})
    t = decode_traffic(eng, cuda_plan(["vram", "pinned", "pinned", "disk"], image), 100.0)
    fixed = weight_bytes_per_token(eng)  # the built layer, the head, one embedding row
    assert t.pcie == 3 * image and t.disk == image and t.cpu == 0
    assert t.memory == fixed + 3 * image
    # bound by the slowest link: the disk's 3 MB at 5 GB/s against PCIe's 9 MB at 25
    assert t.bound_by() == "disk"
    assert t.roofline_tok_s == pytest.approx(5e9 / image)
    doc = t.as_dict()
    assert doc["bytes_per_token"] == {"memory": t.memory, "pcie": 3 * image, "disk": image}
    assert doc["bound_by"] == "disk"


def test_a_hybrid_plan_counts_the_cpu_share_instead_of_its_copy(engine):
    """Layers 1-2 pinned and split: they copy the hybrid plan's GPU part only, and the CPU
    reads its share at its own rate; layer 3 (disk) is copied whole."""
    image = 3_000_000
    hybrid = HybridPlan(cpu_share=0.5, keep=256, layers=[1, 2], cpu_gbps=2.0, pcie_gbps=25.0,
                        threads=1, cpu_bytes_per_token=2_000_000, pcie_bytes_per_token=4_000_000)
    plan = cuda_plan(["vram", "pinned", "pinned", "disk"], image, hybrid=hybrid)
    t = decode_traffic(streamed_engine(engine, {0}), plan, 100.0)
    assert t.pcie == 4_000_000 + image and t.disk == image and t.cpu == 2_000_000
    assert t.gbps["cpu"] == 2.0
    # the CPU's 2 MB at 2 GB/s (1 ms) is the slowest link (disk: 0.6 ms, PCIe: 0.28 ms)
    assert t.bound_by() == "cpu" and t.roofline_tok_s == pytest.approx(1000.0)


def test_an_unmeasured_link_gives_no_roofline(engine):
    plan = cuda_plan(["vram", "pinned", "pinned", "disk"], 1000)
    plan = dataclasses.replace(plan, bandwidth_gbps={"pinned": 25.0})
    t = decode_traffic(streamed_engine(engine, {0}), plan, 100.0)
    assert t.unmeasured() == ["disk"] and t.roofline_tok_s is None and t.bound_by() is None


def test_skipped_layers_move_nothing(engine):
    eng = streamed_engine(engine, {0})
    eng.skip = {3}
    t = decode_traffic(eng, cuda_plan(["vram", "pinned", "pinned", "disk"], 1000), 100.0)
    assert t.disk == 0 and t.pcie == 2000


def test_a_cpu_plan_reads_its_disk_layers_from_the_file(engine):
    """A CPU plan: layers 0-1 resident in RAM (their built weights), 2-3 read every token
    from the file into staging, then computed from there."""
    plan = Plan(device="cpu", tiers=["ram", "ram", "disk", "disk"],
                resident_bytes_per_layer=[0] * 4, file_bytes_per_layer=[7000] * 4,
                fixed_bytes=0, budget=None, staging_buffers=2,
                bandwidth_gbps={"disk": 1.5})
    eng = streamed_engine(engine, {0, 1})
    t = decode_traffic(eng, plan, 20.0)
    assert t.pcie == 0 and t.disk == 14000
    assert t.memory == weight_bytes_per_token(eng) + 14000
    assert t.memory > _layer_bytes(engine.weights.layers[0]) * 2


def test_a_mixture_of_experts_counts_the_experts_a_token_reads(tmp_path):
    """A Qwen3-MoE file (16 experts, 4 used): each layer adds its router whole and 4/16 of
    its routed experts' bytes to the attention the built layer holds; without the file only
    the built linears count (the experts live in banks of their own layouts)."""
    from slipstream.modelfile.gguf_file import GGUFFile

    path = write_synth(tmp_path / "moe.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen3moe")
    eng, gf = cpu_engine(path, ctx=32), GGUFFile(path)
    n, k = eng.cfg.n_experts, eng.cfg.n_experts_used
    assert (n, k) == (16, 4)
    per_layer = []
    for i in range(2):
        exps = [t.n_bytes for name, t in gf.tensors.items()
                if name.startswith(f"blk.{i}.ffn_") and name.endswith("_exps.weight")]
        router = gf.tensors[f"blk.{i}.ffn_gate_inp.weight"].n_bytes
        assert len(exps) == 3
        per_layer.append(sum(exps) * k // n + router)
    assert weight_bytes_per_token(eng, gf) - weight_bytes_per_token(eng) == sum(per_layer)
    t = decode_traffic(eng, None, memory_gbps=10.0, gguf=gf)
    assert t.memory == weight_bytes_per_token(eng, gf)
