"""llama-bench style measurements: pp (a prompt in one batch) and tg (tokens generated one at a
time from an empty context), on random token ids, repeated and averaged.

With a draft, tg decodes speculatively instead (bench_speculative): greedy tokens after a short
prompt of real text, since how many tokens a target pass yields depends on how well the draft
guesses them, which random ids would not show.

On CUDA, time is taken with CUDA events around the whole run, and decode steps are fed from a
device tensor so the host never waits inside the timed loop. Warm-up runs the exact timed
workload once, so Triton compilation and CUDA-graph capture stay out of the figures (the engine
reports capture time separately in `graph_capture_s`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from ..modelfile.gguf_file import GGUFFile
from ..weights.cpu import PackedDecodeLinear
from ..weights.linear import DenseLinear, QuantLinear
from .engine import Engine
from .generate import GenerationStats, TokenSource
from .layer_skip import calibration_text
from .sampler import Sampler, SamplingParams

SPEC_PROMPT_TOKENS = 32  # the speculative tg's prompt: the start of the calibration text
SPEC_ROOM = 64  # context left after a speculative tg: a default tree's verify pass fits


@dataclass
class BenchResult:
    test: str  # "pp512" or "tg128"
    tokens: int
    tok_s: float
    tok_s_std: float
    seconds: list[float]
    # speculative tg only (means over the runs): tokens one target pass yielded, target passes
    # per run, and the seconds per run spent growing trees with the draft and verifying them
    tokens_per_pass: float | None = None
    target_passes: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None

    def as_dict(self) -> dict:
        # a plain run's record keeps its keys: the speculative ones only where they apply
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def mean_s(self) -> float:
        return statistics.mean(self.seconds)

    @property
    def speculative(self) -> bool:
        return self.tokens_per_pass is not None


def _timed(engine: Engine, fn: Callable[[], None]) -> float:
    if engine.device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(engine.device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _ids(engine: Engine, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.cfg.vocab_size, (n,), generator=gen).to(engine.device)


def random_prompt(engine: Engine, n: int, seed: int = 0) -> list[int]:
    """The pp test's random token ids, as a list (a token source's prompt)."""
    return _ids(engine, n, seed).tolist()


def bench_prefill(engine: Engine, n_tokens: int, reps: int = 3, seed: int = 0) -> BenchResult:
    ids = _ids(engine, n_tokens, seed)

    def run() -> None:
        engine.reset()
        engine.forward(ids)

    run()  # warm-up: kernel compilation, workspaces, thread pools
    times = [_timed(engine, run) for _ in range(reps)]
    return _result(f"pp{n_tokens}", n_tokens, times)


def bench_decode(engine: Engine, n_tokens: int, reps: int = 3, seed: int = 0) -> BenchResult:
    ids = _ids(engine, n_tokens, seed)

    def run() -> None:
        engine.reset()
        for i in range(n_tokens):
            engine.decode(ids[i: i + 1])

    run()  # warm-up, including graph capture for every bucket the run touches
    times = [_timed(engine, run) for _ in range(reps)]
    return _result(f"tg{n_tokens}", n_tokens, times)


def bench_first_token(engine: Engine, source: TokenSource, prompt: list[int],
                      reps: int = 3) -> BenchResult:
    """Time to first token: from a fresh context to the first generated token read back on
    the host, through the token source generation uses (a speculative one prefills its draft
    too), greedy; as llama.cpp's prompt eval plus the first sample. Warmed as bench_prefill."""
    sampler = Sampler(SamplingParams(temperature=0.0), device=engine.device)

    def run() -> float:
        t0 = time.perf_counter()
        tokens = source(engine, prompt, sampler, 1, GenerationStats())
        int(next(tokens))  # read back: the host has the token
        seconds = time.perf_counter() - t0
        tokens.close()
        return seconds

    run()
    times = [run() for _ in range(reps)]
    return _result(f"ttft{len(prompt)}", len(prompt), times)


def spec_prompt(tokenize: Callable[[str], list[int]], n: int = SPEC_PROMPT_TOKENS) -> list[int]:
    """The first n tokens of the calibration text shipped with the package (plain prose)."""
    return tokenize(calibration_text())[:n]


def bench_speculative(engine: Engine, source: TokenSource, prompt: list[int], n_tokens: int,
                      reps: int = 3) -> BenchResult:
    """tg through a speculative token source: n_tokens greedy tokens after `prompt`, timed
    from the token the prefill draws (both models' prefills stay out, as tg has none) to the
    last one. Greedy, so every run decodes the same tokens with the same trees."""
    sampler = Sampler(SamplingParams(temperature=0.0), device=engine.device)

    def run() -> tuple[float, dict]:
        stats = GenerationStats()
        tokens = source(engine, prompt, sampler, n_tokens + 1, stats)
        next(tokens)  # the prefills
        seconds = _timed(engine, lambda: _drain(tokens))
        return seconds, stats.extra  # the source wrote its figures when it ran out

    run()  # warm-up: as bench_decode's, and the draft's too
    runs = [run() for _ in range(reps)]
    res = _result(f"tg{n_tokens}", n_tokens, [t for t, _ in runs])
    extras = [x for _, x in runs]

    def mean(key: str) -> float:
        return statistics.mean(float(x[key]) for x in extras)

    res.tokens_per_pass = mean("spec_tokens_per_pass")
    res.target_passes = mean("spec_target_passes")
    res.draft_s = mean("spec_draft_s")
    res.verify_s = mean("spec_verify_s")
    return res


def _drain(tokens: Iterator[torch.Tensor]) -> None:
    for _ in tokens:
        pass


def _linear_bytes(lin) -> int:
    """Bytes one decode matvec reads of a resident linear."""
    if isinstance(lin, PackedDecodeLinear):  # CPU decode reads the packed copy
        lin = lin.packed
    if isinstance(lin, QuantLinear):
        return lin.packed.nbytes
    if isinstance(lin, DenseLinear):
        return lin.weight.numel() * lin.weight.element_size()
    return int(getattr(lin, "nbytes", 0) or 0)  # the CPU's packed layouts


def _layer_bytes(layer, routed: int = 0) -> int:
    """Bytes one decode step reads of a built layer's linears, and `routed`: its mixture of
    experts' share (_routed_bytes), whose banks hold their experts in layouts of their own."""
    fused = [layer.attn_qkv, layer.ffn_gate_up]
    parts = [layer.attn_q, layer.attn_k, layer.attn_v] if layer.attn_qkv is None else []
    parts += [layer.ffn_gate, layer.ffn_up] if layer.ffn_gate_up is None else []
    return sum(_linear_bytes(x) for x in fused + parts + [layer.attn_output, layer.ffn_down]) \
        + routed


def _routed_bytes(engine: Engine, gguf: GGUFFile | None, i: int) -> int:
    """The bytes a decode token reads of layer i's mixture of experts, from the file: the
    router and any shared expert whole, and n_experts_used of the n_experts routed experts
    (a token reads exactly that many, however skewed the routing); 0 for a dense layer or
    without the file."""
    if gguf is None:
        return 0
    cfg = engine.cfg.layer(i)
    if not cfg.n_experts:
        return 0
    total = 0
    for name, t in gguf.tensors.items():
        if not name.startswith(f"blk.{i}.ffn_") or "norm" in name:
            continue
        if "_exps." in name:
            total += t.n_bytes * cfg.n_experts_used // cfg.n_experts
        elif "shexp" in name or name.startswith(f"blk.{i}.ffn_gate_inp."):
            total += t.n_bytes  # the dense FFN beside (Gemma 4) is a built linear, counted
    return total


def _fixed_bytes(engine: Engine) -> int:
    """The head's bytes and one embedding row's (a later pipeline stage has neither)."""
    w = engine.weights
    embed = w.embed.raw.shape[1] if w.embed is not None else 0
    return (_linear_bytes(w.output) if w.output is not None else 0) + embed


def weight_bytes_per_token(engine: Engine, gguf: GGUFFile | None = None) -> int:
    """Bytes of weights one decode token reads: every linear layer once (of the layers not
    skipped), one embedding row, and a mixture of experts' router, shared expert and routed
    experts (_routed_bytes: counted from `gguf`). A streamed layer has no resident weights to
    measure: its tensors' bytes in `gguf` count (left out without it). decode_traffic says
    which link carries them."""
    total = _fixed_bytes(engine)
    for i, layer in enumerate(engine.weights.layers):
        if i in engine.skip:
            continue
        if layer is None:
            prefix = f"blk.{i}."
            total += sum(t.n_bytes for name, t in (gguf.tensors.items() if gguf else ())
                         if name.startswith(prefix))
            continue
        total += _layer_bytes(layer, _routed_bytes(engine, gguf, i))
    return total


# Tiers whose layers a decode step reads where they rest (RAM on a CPU, VRAM on CUDA); a CPU
# "packed" layer's decode image is in RAM too
RESIDENT_TIERS = ("ram", "packed", "vram")


@dataclass
class DecodeTraffic:
    """The bytes one decode token moves, by link. A streamed layer costs more than a read:
    on CUDA its image crosses PCIe into a slot (after a disk read, for the disk tier) and the
    GPU then reads it from the slot; on a CPU it is read from the file into a staging buffer
    and computed from there. Hybrid decode's split layers copy only their GPU part, while the
    CPU reads its share of their FFN from its packed copy."""

    memory: int  # read by compute from RAM (CPU) or VRAM (CUDA): every layer, head, a row
    pcie: int = 0  # CUDA: host-to-device copies of the pinned and disk tiers
    disk: int = 0  # read from the file every token
    cpu: int = 0  # hybrid decode: the CPU's shares of the split layers' FFNs
    # GB/s of each link, as measured (memory by the bench, the others at load)
    gbps: dict[str, float] = field(default_factory=dict)

    def links(self) -> dict[str, int]:
        return {k: v for k, v in (("memory", self.memory), ("pcie", self.pcie),
                                  ("disk", self.disk), ("cpu", self.cpu)) if v}

    def unmeasured(self) -> list[str]:
        return [k for k in self.links() if not self.gbps.get(k)]

    @property
    def roofline_tok_s(self) -> float | None:
        """Decode's upper bound: every link carries its bytes at its measured rate, all of
        them at once (the store overlaps reads, copies and compute), so the slowest link
        bounds the token. None where a link that carries bytes was not measured."""
        if self.unmeasured():
            return None
        seconds = max(n / (self.gbps[k] * 1e9) for k, n in self.links().items())
        return 1.0 / seconds if seconds else None

    def bound_by(self) -> str | None:
        """The link the roofline comes from."""
        if self.unmeasured() or not self.links():
            return None
        return max(self.links(), key=lambda k: self.links()[k] / self.gbps[k])

    def as_dict(self) -> dict:
        rate = self.roofline_tok_s
        return {"bytes_per_token": self.links(), "gbps": {k: round(v, 2) for k, v in
                                                         self.gbps.items() if k in self.links()},
                "roofline_decode_tok_s": round(rate, 1) if rate else None,
                "bound_by": self.bound_by()}


def decode_traffic(engine: Engine, plan, memory_gbps: float,
                   gguf: GGUFFile | None = None) -> DecodeTraffic:
    """The bytes one decode token moves over each link, from the tier plan (memory.Plan;
    None: every layer resident) and the layers the engine built: a resident layer's bytes are
    measured on its weights, a streamed one's are the plan's image (or GGUF span) of it, which
    the store moves whole. Links' rates: `memory_gbps` for memory, the plan's measurements
    for PCIe ("pinned") and disk, the hybrid plan's for the CPU's shares."""
    layers = engine.weights.layers
    tiers = list(plan.tiers) if plan is not None else []
    described = len(tiers) == len(layers)
    if not described:  # no plan, or one stage's of several: what is built, the GGUF's spans
        tiers = ["ram" if layer is not None else "disk" for layer in layers]

    def span(i: int) -> int:
        if described:
            return plan.file_bytes_per_layer[i]
        return sum(t.n_bytes for name, t in (gguf.tensors.items() if gguf else ())
                   if name.startswith(f"blk.{i}."))
    cuda = plan is not None and plan.device == "cuda"
    split = set(plan.hybrid.layers) if cuda and plan.hybrid is not None else set()
    t = DecodeTraffic(memory=_fixed_bytes(engine), gbps={"memory": memory_gbps})
    for i, (layer, tier) in enumerate(zip(layers, tiers)):
        if i in engine.skip:
            continue
        if tier in RESIDENT_TIERS:
            t.memory += _layer_bytes(layer, _routed_bytes(engine, gguf, i)) \
                if layer is not None else plan.resident_bytes_per_layer[i]
            continue
        moved = span(i)
        if i not in split:  # a split layer's copy: the hybrid plan's total, below
            t.memory += moved
            t.pcie += moved if cuda else 0
        t.disk += moved if tier == "disk" else 0
    if split:
        hybrid = plan.hybrid
        t.memory += hybrid.pcie_bytes_per_token
        t.pcie += hybrid.pcie_bytes_per_token
        t.cpu = hybrid.cpu_bytes_per_token
        t.gbps["cpu"] = hybrid.cpu_gbps
    if plan is not None:
        for link, key in (("pcie", "pinned"), ("disk", "disk")):
            if plan.bandwidth_gbps.get(key):
                t.gbps[link] = plan.bandwidth_gbps[key]
    return t


def _result(test: str, n: int, times: list[float]) -> BenchResult:
    rates = [n / t for t in times]
    std = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return BenchResult(test, n, statistics.mean(rates), std, times)
