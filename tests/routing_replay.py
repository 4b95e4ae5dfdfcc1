"""A mixture of experts' routing held fixed between two runs of the same file, for tests that
compare two engines (the GPU against the CPU, "fast" against "exact").

Top-k routing turns rounding into jumps: where a row's k-th and (k+1)-th router logits nearly
tie, a difference of float32 rounding between two engines picks different experts, and that
row's output moves by the difference of two experts' outputs. On the 4-layer Mixtral and
Qwen3-MoE synth files of the GPU tests, router inputs perturbed by one part in a thousand (the
size of the GPU's differences from the CPU at "exact") moved the prefill logits by 5.4% and 2.0%
relative on the CPU alone, and 3e-6 moved them by 1e-5: the same 5.4% and 2.0% the GPU showed. So
a comparison of two engines runs the second on the first's routing (`replayed_routing`), which
leaves the rest of the arithmetic to the tolerance, and checks the second engine's own choices
separately: the same experts wherever the first run's choice was decisive
(`assert_same_decisive_choices`)."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

import slipstream.model.moe as moe

_ROUTE = moe.route
_SIGNATURE = inspect.signature(_ROUTE)


@dataclass
class RoutingCall:
    """One call of model.moe.route, on the CPU: its (T, k) weights and expert ids, and each
    row's margin: the k-th router logit less the (k+1)-th, over the row's largest |logit|."""
    weights: torch.Tensor
    ids: torch.Tensor
    margin: torch.Tensor


def _margin(args: dict) -> torch.Tensor:
    if args["selection_bias"] is not None or args["groups"]:
        raise NotImplementedError("margins of grouped or bias-selected routing")
    logits = F.linear(args["h"].to(args["router"].dtype), args["router"], args["bias"]).float()
    k = args["top_k"]
    if k >= logits.shape[-1]:  # every expert chosen: no choice to flip
        return torch.full(logits.shape[:1], float("inf"))
    top = logits.topk(k + 1, dim=-1).values
    return ((top[:, k - 1] - top[:, k]) / logits.abs().amax(-1).clamp_min(1e-30)).cpu()


@contextmanager
def _routing_patched(hook) -> Iterator[None]:
    """model.moe.route replaced by hook(args, weights, ids) -> (weights, ids), where args are
    the call's bound arguments and (weights, ids) the real route's result."""
    def patched(*a, **kw):
        bound = _SIGNATURE.bind(*a, **kw)
        bound.apply_defaults()
        return hook(bound.arguments, *_ROUTE(*a, **kw))

    moe.route = patched
    try:
        yield
    finally:
        moe.route = _ROUTE


@contextmanager
def recorded_routing() -> Iterator[list[RoutingCall]]:
    """Every route call in the block, in order, appended to the list yielded."""
    calls: list[RoutingCall] = []

    def record(args, weights, ids):
        calls.append(RoutingCall(weights.cpu(), ids.cpu(), _margin(args)))
        return weights, ids

    with _routing_patched(record):
        yield calls


@contextmanager
def replayed_routing(calls: list[RoutingCall]) -> Iterator[list[RoutingCall]]:
    """Each route call in the block returns the recorded call of the same rank instead of its
    own choice (the two runs must route the same rows in the same order); its own choice is
    appended, with its margins, to the list yielded."""
    own: list[RoutingCall] = []

    def replay(args, weights, ids):
        if len(own) >= len(calls):
            raise AssertionError(f"route called more than the {len(calls)} recorded times")
        rec = calls[len(own)]
        if rec.ids.shape != ids.shape:
            raise AssertionError(f"route call {len(own)}: ids {tuple(ids.shape)}, recorded "
                                 f"{tuple(rec.ids.shape)}")
        own.append(RoutingCall(weights.cpu(), ids.cpu(), _margin(args)))
        return rec.weights.to(weights.device, weights.dtype), rec.ids.to(ids.device)

    with _routing_patched(replay):
        yield own


def assert_same_decisive_choices(recorded: list[RoutingCall], own: list[RoutingCall],
                                 tau: float = 1e-2, weight_tol: float | None = 1e-2) -> int:
    """The replaying run's own router chose the recorded experts (as a set) in every row where
    the recorded choice was decisive (margin over tau), with each expert's weight within
    weight_tol (None: the weights not compared, for runs whose router inputs differ by more
    than rounding: "fast" against "exact"); returns the number of rows left out as near ties."""
    assert len(own) == len(recorded), (len(own), len(recorded))
    ties = 0
    for i, (rec, got) in enumerate(zip(recorded, own)):
        decisive = rec.margin > tau
        ties += int((~decisive).sum())
        want_ids, order = rec.ids[decisive].sort(dim=-1)
        got_ids, got_order = got.ids[decisive].sort(dim=-1)
        assert torch.equal(got_ids, want_ids), f"route call {i}: other experts at decisive rows"
        want_w = rec.weights[decisive].gather(1, order).double()
        got_w = got.weights[decisive].gather(1, got_order).double()
        if want_w.numel() and weight_tol is not None:
            worst = (got_w - want_w).abs().max().item()
            assert worst <= weight_tol, f"route call {i}: weights {worst:.3e} apart"
    return ties
