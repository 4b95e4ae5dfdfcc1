"""The CUDA engine (Triton kernels, quantized weights) against the CPU engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import slipstream

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is a city with a long history of",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def cpu_model(smollm_path):
    # the float32 CPU path is the reference; the default float16 one differs by ~1e-3
    return slipstream.load(smollm_path, device="cpu", ctx=256, precision="exact")


@pytest.fixture(scope="module")
def gpu_model(smollm_path):
    """precision="exact": fp32 GEMVs on the exact GGUF weights, the path checked token for
    token against the CPU."""
    pytest.importorskip("triton")
    return slipstream.load(smollm_path, device="cuda", ctx=256, precision="exact")


@pytest.fixture(scope="module")
def gpu_fast(smollm_path):
    """The default precision="fast": decode GEMVs with int8 activations (as llama.cpp's)."""
    pytest.importorskip("triton")
    return slipstream.load(smollm_path, device="cuda", ctx=256)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_gpu_logits_match_cpu(cpu_model, gpu_model, gpu_fast, prompt, precision):
    ids = cpu_model.tokenize(prompt)
    a = cpu_model.logits(ids)
    b = (gpu_model if precision == "exact" else gpu_fast).logits(ids)
    assert b.dtype == torch.float32 and b.shape == a.shape
    assert float((a - b).norm() / a.norm()) < 2e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_gpu_decode_steps_match_cpu(cpu_model, gpu_model, gpu_fast, precision):
    """One-token steps go through the decode GEMVs (fp32, or int8 activations when fast)."""
    gpu = gpu_model if precision == "exact" else gpu_fast
    ids = cpu_model.tokenize(PROMPTS[0])
    for m in (cpu_model, gpu):
        m.engine.reset()
        m.engine.forward(ids[:3])
    steps = [(cpu_model.engine.forward(ids[i:i + 1]).cpu(),
              gpu.engine.forward(ids[i:i + 1]).cpu()) for i in range(3, len(ids))]
    if precision == "exact":
        for a, b in steps:
            assert float((a - b).norm() / a.norm()) < 1e-2
        return
    # int8 activations (per block of 32, as llama.cpp's q8_1): SmolLM's outlier channels make
    # the blocks that hold them coarse. One-token steps run the fused RoPE/attention kernels,
    # as captured decode always did: on the H200 the worst step was 8.8 % through them and
    # 5.5 % through the torch ops, with exact precision at 0.15 % either way; the argmax
    # agreement below
    # and the perplexity test after it bound what this costs in generation
    errs = [float((a - b).norm() / a.norm()) for a, b in steps]
    assert max(errs) < 0.12, errs
    agree = np.mean([int(a.argmax()) == int(b.argmax()) for a, b in steps])
    assert agree >= 0.9, agree


def test_fast_precision_costs_little_perplexity(cpu_model, gpu_model, gpu_fast):
    """What int8 activations cost where they are used, in generation: perplexity of a page of
    prose through the decode path at both precisions. Exact must equal the CPU's; fast may
    lose at most 2 % (llama.cpp's q8_1 activations cost a fraction of a percent on larger
    models; SmolLM's outlier channels make its blocks coarser)."""
    from slipstream.runtime.perplexity import perplexity

    text = (Path(__file__).parents[1] / "data" / "prose.txt").read_text()
    ids = cpu_model.tokenize(text, add_special=True)
    ppl = {name: perplexity(lambda c, m=m: m.logits(c, one_at_a_time=True), ids, 128,
                            max_chunks=4).ppl
           for name, m in (("cpu", cpu_model), ("exact", gpu_model), ("fast", gpu_fast))}
    assert abs(ppl["exact"] / ppl["cpu"] - 1) < 2e-3, ppl
    assert abs(ppl["fast"] / ppl["exact"] - 1) < 2e-2, ppl


def test_greedy_64_tokens_equal_cpu(cpu_model, gpu_model):
    """Greedy generation at precision "exact" gives the CPU's tokens, except where the two
    paths' own logit difference (float32 sums in other orders, bounded by
    test_gpu_decode_steps_match_cpu) is larger than a near-tie: there greedy may part, the GPU
    taking the CPU's runner-up, and the test shows it. An H100 parted at token 60 at a top-2
    gap of 0.003; an H200 gave all 64
    tokens."""
    prompt = "Once upon a time, in a small village by the sea,"
    a = [e.id for e in cpu_model.generate(prompt, max_tokens=64, temperature=0)]
    b = [e.id for e in gpu_model.generate(prompt, max_tokens=64, temperature=0)]
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first_diff is None:
        assert a == b
        return
    # the step where they parted, through the decode path both generations took
    ctx = cpu_model.tokenize(prompt) + a[:first_diff]
    cpu = cpu_model.logits(ctx, one_at_a_time=True)[-1]
    gpu = gpu_model.logits(ctx, one_at_a_time=True)[-1].cpu()
    top = cpu.topk(2)
    gap = float(top.values[0] - top.values[1])
    apart = float((cpu - gpu).abs().max())
    message = (f"first divergence at token {first_diff}: GPU {b[first_diff]}, CPU top-2 "
               f"{top.indices.tolist()} {gap:.2e} apart, the paths' largest logit difference "
               f"there {apart:.2e}")
    print(message)
    assert b[first_diff] == int(top.indices[1]), message  # the CPU's runner-up
    assert gap <= 2 * apart, message  # a tie within the two paths' own difference
    assert float((cpu - gpu).norm() / cpu.norm()) < 1e-2, message


@pytest.fixture(scope="module")
def synth_path(tmp_path_factory):
    from slipstream.synth import write_synth

    return write_synth(tmp_path_factory.mktemp("gpu") / "s.gguf", "tiny", "Q4_K_M", n_layers=3,
                       from_floats=True, std=0.08, seed=2)


@pytest.mark.parametrize("fused,precision", [("1", "exact"), ("0", "exact"), ("1", "fast")])
def test_graph_decode_matches_cpu_on_synthetic_model(synth_path, fused, precision, monkeypatch):
    """CUDA-graph decode (fused RoPE/cache/attention kernels, or the torch ops) against the
    float32 CPU engine, step by step, past a graph bucket boundary."""
    pytest.importorskip("triton")
    monkeypatch.setenv("SLIPSTREAM_FUSED_DECODE", fused)
    cpu = slipstream.load(synth_path, device="cpu", ctx=320, precision="exact")
    gpu = slipstream.load(synth_path, device="cuda", ctx=320, precision=precision)
    assert gpu.engine.use_graphs
    prompt = list(range(3, 250))
    cpu.engine.forward(prompt)
    gpu.engine.forward(prompt)
    for i, tok in enumerate(range(10, 30)):  # positions 247..266 cross the 256 bucket
        a = cpu.engine.forward([tok])
        b = gpu.engine.decode(torch.tensor([tok], device="cuda")).float().cpu()
        # fast: int8 activations; 3.9% was measured on the H200 at the worst step
        assert float((a - b).norm() / a.norm()) < (1e-2 if precision == "exact" else 6e-2), \
            f"step {i}"
    assert len(gpu.engine._graphs.graphs) == 2
