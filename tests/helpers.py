"""Small shared helpers for tests: synthetic GGUF files and byte patching."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import torch

from llamacpp_ref import rel_err
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory import ResidentLayerStore
from slipstream.precision import Precision
from slipstream.runtime.engine import Engine
from slipstream.runtime.stage import Stage
from slipstream.weights import load_weights


def cpu_engine(path: str | Path, ctx: int = 256, precision: str = "fast") -> Engine:
    """A CPU engine on a GGUF file without the tokenizer (for model-math tests)."""
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    weights = load_weights(gf, cfg, torch.device("cpu"), Precision.of(precision, torch.device("cpu")))
    return Engine(cfg, weights, cpu_stages(cfg, weights, ctx))


def cpu_stages(cfg: ModelConfig, weights, ctx: int, cuts: tuple[int, ...] = ()) -> list[Stage]:
    """CPU stages over resident layers, split before each layer index in `cuts`."""
    bounds = [0, *cuts, cfg.n_layers]
    store = ResidentLayerStore(weights.layers)
    return [Stage.build(cfg, torch.device("cpu"), range(a, b), store, ctx, torch.float32,
                        weights.rope_freqs_for(ctx)) for a, b in zip(bounds, bounds[1:])]


class NormsOnly:
    """A layer builder that keeps only the norms: enough for a layer image, without Triton
    (the CUDA store's bookkeeping runs on the CPU with faked streams, tests/memory/conftest)."""

    def __init__(self, builder):
        self.builder = builder

    def build(self, src, i: int):
        import dataclasses

        from slipstream.model.llama import LayerWeights

        full = self.builder.build(src, i)
        kept = {f.name: None for f in dataclasses.fields(LayerWeights)}
        kept.update(attn_norm=full.attn_norm, ffn_norm=full.ffn_norm)
        return LayerWeights(**kept)


def tensor_info_offset(path: Path, name: str) -> int:
    """Byte offset of a tensor's info record (just after its name) in the GGUF header."""
    data = path.read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.find(key)
    assert at >= 0, name
    return at + len(key)


def patch(path: Path, offset: int, payload: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload)


def streaming_synth(directory: Path, n_layers: int, seed: int) -> Path:
    """The small Q4_K_M model the streaming GPU tests place across tiers (mixed formats, so
    layers differ in their planes; weights from floats, so the logits are sane)."""
    from slipstream.synth import write_synth

    return write_synth(directory / "s.gguf", "tiny", "Q4_K_M", n_layers=n_layers,
                       from_floats=True, std=0.08, seed=seed)


STREAM_PROMPT = list(range(5, 140, 3))


def streamed_logits(model, steps: int = 12) -> list[torch.Tensor]:
    """Prefill logits of STREAM_PROMPT and `steps` greedy decode steps, eager on both sides so
    a streamed and a resident model run the same kernels (for bit-identity tests)."""
    model.engine.use_graphs = False
    model.engine.reset()
    out = [model.engine.forward(STREAM_PROMPT, all_logits=True).cpu()]
    tok = torch.tensor([7], device=model.engine.device)
    for _ in range(steps):
        logits = model.engine.decode(tok)
        out.append(logits.cpu())
        tok = logits[-1].argmax().view(1)
    if model.engine.device.type == "cuda":
        torch.cuda.synchronize()
    return out


def streamed_slack(plan) -> int:
    """memory.setup.streamed_slack."""
    from slipstream.memory.setup import streamed_slack as slack_of

    return slack_of(plan)


def vram_budget_for(model, resident_layers: int, slack: int = 1) -> int:
    """A VRAM budget for `resident_layers` of `model`'s plan in VRAM, the rest streamed
    (memory.setup.streamed_vram_budget)."""
    from slipstream.memory.setup import streamed_vram_budget

    return streamed_vram_budget(model.plan, resident_layers, slack)


def cpu_budget(path: str | Path, packed: int = 0, whole: int = 0, precision: str = "fast",
               ctx: int = 64) -> int:
    """A RAM budget for a CPU plan of `path` that streams: at "fast" the images of the first
    `packed` layers held (and, where every layer is packed, the first `whole` whole), the rest
    streamed, with the head a streaming plan holds (memory.setup.cpu_fixed_bytes); at "exact"
    the first `whole` layers resident, the rest streamed."""
    import slipstream
    from slipstream.memory.setup import cpu_fixed_bytes, head_dense_on_demand

    plan = slipstream.plan(path, device="cpu", ctx=ctx, precision=precision, measure=False)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    prec = Precision.of(precision, torch.device("cpu"))
    fixed = cpu_fixed_bytes(gf, cfg, prec, ctx, head_on_demand=head_dense_on_demand(gf, prec))
    gf.close()
    files, full = plan.file_bytes_per_layer, plan.resident_bytes_per_layer
    staging = plan.staging_buffers * max(files) + plan.prefill_staging
    if precision == "exact":
        return fixed + staging + sum(full[:whole]) + 1
    return fixed + staging + sum(files[:packed]) + \
        sum(f - m for f, m in zip(full[:whole], files[:whole])) + 1



def file_config(path) -> "ModelConfig":
    """The ModelConfig of a GGUF file, its tensor names checked against the layer count."""
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile

    gf = GGUFFile(path)
    return ModelConfig.from_metadata(gf.metadata, set(gf.tensors))


def rel64(a, b) -> float:
    """|a - b| / |b| in float64: the GPU tests' agreement measure."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_decisive_top1(ref, got, margin: float) -> None:
    """Top-1 equal wherever the reference's top-2 gap exceeds `margin` (a near tie may go
    either way between two correct paths)."""
    import torch

    top = ref.topk(2, dim=-1).values
    decisive = (top[..., 0] - top[..., 1]) > margin
    assert torch.equal(ref.argmax(-1)[decisive], got.argmax(-1)[decisive])


def assert_prefill_and_decode_match(engine, ids, ref, tol: float) -> None:
    """An engine's all-position logits for `ids` within `tol` (relative) of `ref` with the same
    top-1 everywhere: prefill in one pass, then again after a reset with the first 5 tokens as a
    prefill and the rest one at a time through the cache."""
    import torch

    from llamacpp_ref import rel_err

    ours = engine.forward(ids, all_logits=True)
    assert rel_err(ours, ref) < tol
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    engine.reset()
    stepped = torch.cat([engine.forward(ids[:5], all_logits=True)]
                        + [engine.forward(ids[i:i + 1]) for i in range(5, len(ids))])
    assert rel_err(stepped, ref) < tol
    assert torch.equal(stepped.argmax(-1), ref.argmax(-1))


def variant(engine: Engine, cfg_change: dict | None = None, moe_change=None) -> Engine:
    """The engine's model with its config fields (`cfg_change`) or every mixture-of-experts
    layer's MoeWeights (`moe_change`: a dict of fields, or a function of the MoeWeights)
    replaced: same weights otherwise, fresh CPU caches. Negative controls build on it."""
    cfg, weights = engine.cfg, engine.weights
    if cfg_change:
        cfg = dataclasses.replace(cfg, **cfg_change)
    if moe_change is not None:
        change = moe_change if callable(moe_change) else \
            (lambda m: dataclasses.replace(m, **moe_change))
        weights = dataclasses.replace(weights, layers=[
            dataclasses.replace(w, moe=change(w.moe)) if w.moe is not None else w
            for w in weights.layers])
    return Engine(cfg, weights, cpu_stages(cfg, weights, engine.ctx))


def assert_controls_miss(variants, ids, ref, floor: float) -> None:
    """Each negative control (name -> engine) lands farther than `floor` (relative) from the
    reference logits, so that the comparison that passed could have failed."""
    for name, engine in variants.items():
        err = rel_err(engine.forward(ids, all_logits=True), ref)
        assert err > floor, (name, err)


def assert_disk_streaming_gives_resident_bits(path, precision: str, ids: list[int]) -> None:
    """A CPU load of `path` whose RAM budget holds one layer (the others read from the file per
    pass) gives the resident load's logits bit for bit, for decode- and prefill-sized passes,
    and its greedy tokens."""
    import slipstream

    resident = slipstream.load(path, device="cpu", ctx=64, precision=precision)
    n = resident.engine.cfg.n_layers
    budget = (cpu_budget(path, whole=1, precision="exact") if precision == "exact"
              else cpu_budget(path, packed=1))
    streamed = slipstream.load(path, device="cpu", ctx=64, precision=precision,
                               placement=slipstream.Placement(ram_budget=budget))
    try:
        assert streamed.plan.tiers.count("disk") == n - 1, streamed.plan.tiers
        for prompt in (ids[:8], ids):
            assert torch.equal(resident.logits(prompt), streamed.logits(prompt))
        greedy = dict(max_tokens=8, temperature=0)
        assert [e.id for e in resident.generate(ids[:6], **greedy)] == \
            [e.id for e in streamed.generate(ids[:6], **greedy)]
    finally:
        resident.close()
        streamed.close()


def refuse_expert_loop(monkeypatch) -> None:
    """Make the CPU's op-by-op expert loop (weights.cpu.expert_decode.expert_sum) fail, so a
    test shows that a token's experts took the one native call."""
    def refuse(*args, **kwargs):
        raise AssertionError("the op-by-op loop ran")

    monkeypatch.setattr("slipstream.weights.cpu.expert_decode.expert_sum", refuse)
