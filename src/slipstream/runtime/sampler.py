"""Token sampling: penalties, top-k, top-p, min-p, temperature; seeded and reproducible.

The order follows llama.cpp's default chain: penalties, then top-k, top-p and min-p on the
penalized logits, then temperature, then a draw. Temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BadArgument


class BadSamplingParams(BadArgument):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables; llama.cpp style divide/multiply
    repeat_last_n: int = 64  # how many recent tokens the penalties look at
    frequency_penalty: float = 0.0  # OpenAI style, subtracted per occurrence
    presence_penalty: float = 0.0  # OpenAI style, subtracted once if present
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature", self.temperature, ">= 0"),
            (self.top_k >= 0, "top_k", self.top_k, ">= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty", self.repeat_penalty, "> 0"),
            (self.repeat_last_n >= 0, "repeat_last_n", self.repeat_last_n, ">= 0"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise BadSamplingParams(f"{name}={value} is invalid: must be {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        # set on the device when logits held NaN or Inf (the token drawn then is meaningless);
        # read with the token, so the check adds no sync of its own (runtime.generate)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def penalize(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.repeat_last_n == 0 or history.numel() == 0 or (
                p.repeat_penalty == 1.0 and p.frequency_penalty == 0 and p.presence_penalty == 0):
            return logits
        recent = history[-p.repeat_last_n:].to(logits.device)
        counts = torch.zeros_like(logits).scatter_add_(0, recent, torch.ones_like(
            recent, dtype=logits.dtype))
        present = counts > 0
        if p.repeat_penalty != 1.0:
            penalized = torch.where(logits > 0, logits / p.repeat_penalty,
                                    logits * p.repeat_penalty)
            logits = torch.where(present, penalized, logits)
        return logits - counts * p.frequency_penalty - present.to(logits.dtype) * \
            p.presence_penalty

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) every token that top-k, top-p or min-p rules out."""
        p = self.params
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if p.min_p > 0:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return logits

    def __call__(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """logits: float32 (vocab,); history: previous token ids (n,) long. Returns a 0-d id.

        Non-finite logits set `nonfinite` and are replaced by zeros, so that drawing still
        works (multinomial rejects NaN, on CUDA with a device-side assert) until the caller
        reads the flag and stops."""
        logits = logits.float()
        bad = ~torch.isfinite(logits).all()
        self.nonfinite |= bad
        logits = self.penalize(torch.where(bad, torch.zeros_like(logits), logits), history)
        if self.params.greedy:
            return logits.argmax()
        logits = self.filter(logits) / self.params.temperature
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator)[0]
