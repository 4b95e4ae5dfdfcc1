"""The linear attention of synthesized Qwen3.5 files (synth.py): its metadata, in
Qwen3.5's proportions scaled to the shape, and the values of its tensors that random
weights would make meaningless (the decay, the conv's taps, the shared expert's gate)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # type hints only: synth imports this module
    from .synth import SynthShape

# Qwen3.5-35B-A3B: 16 key heads and 32 value heads of 128, a 4-tap conv, every fourth layer
# full attention. The tiny shape keeps the value heads a whole K-quant block (8 x 32 = 256)
# and twice the key heads (the tiled value-to-key mapping exercised), with every second
# layer full attention so that a 2-layer file has one of each
LINEAR_TINY = dict(conv_kernel=4, state=32, groups=4, heads=8, interval=2)
LINEAR_FULL = dict(conv_kernel=4, state=128, groups=16, heads=32, interval=4)
ARCHS = ("qwen35", "qwen35moe")


def rope_sections(rope_dim: int) -> list[int]:
    """M-RoPE sections over rope_dim / 2 pairs as Qwen3.5's [11, 11, 10, 0] splits 32:
    time and height a third each rounded up, width the rest, none for the fourth."""
    pairs = rope_dim // 2
    third = (pairs + 2) // 3
    return [third, third, pairs - 2 * third, 0]


def ssm_metadata(shape: SynthShape, arch: str, rope_dim: int) -> dict[str, object]:
    """The keys of a synthesized `qwen35` or `qwen35moe` file beyond the experts'."""
    if arch not in ARCHS:
        return {}
    d = LINEAR_TINY if shape.hidden <= 256 else LINEAR_FULL
    return {f"{arch}.ssm.conv_kernel": d["conv_kernel"], f"{arch}.ssm.state_size": d["state"],
            f"{arch}.ssm.group_count": d["groups"], f"{arch}.ssm.time_step_rank": d["heads"],
            f"{arch}.ssm.inner_size": d["heads"] * d["state"],
            f"{arch}.full_attention_interval": d["interval"],
            f"{arch}.rope.dimension_sections": rope_sections(rope_dim)}


def ssm_data(name: str, shape: tuple[int, ...], rng: np.random.Generator
             ) -> np.ndarray | None:
    """Values for the tensors whose meaning random weights of the usual spread would lose,
    as transformers initialises them (None: any other tensor):
    - ssm_a = -exp(A_log), A_log = log(U(1, 16)): decays from -1 to -16;
    - ssm_dt.bias: the inverse softplus of a time step between 0.001 and 0.1, log-uniform,
      so that exp(g) spreads from near 0 to near 1 across heads and tokens;
    - ssm_conv1d: U(-1, 1) / sqrt(kernel), a conv's default;
    - ffn_gate_inp_shexp: a row whose dot product with a normed input spreads over a few
      units, so that the shared expert's sigmoid gate moves between tokens."""
    base = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
    if base == "ssm_a":
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    if base == "ssm_dt":
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if base == "ssm_conv1d":
        return (rng.uniform(-1.0, 1.0, shape) / np.sqrt(shape[-1])).astype(np.float32)
    if base == "ffn_gate_inp_shexp":
        return (rng.standard_normal(shape) / np.sqrt(shape[-1]) * 2.0).astype(np.float32)
    return None
