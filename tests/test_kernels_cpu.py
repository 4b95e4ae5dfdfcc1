"""The Triton-free plumbing of slipstream.kernels, on the CPU (the kernels themselves are tested
on CUDA in tests/gpu/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.splitk import in_row_blocks


def _matmul_launch(weight: torch.Tensor, limit: int, calls: list):
    """A stand-in for a kernel launch that takes at most `limit` rows: x @ weight^T, into the
    block it is given if any (as qgemm writes its output in place), else a new tensor."""

    def launch(xb: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        assert xb.shape[0] <= limit
        calls.append((xb.shape[0], into is not None))
        y = (xb @ weight.t()).to(into.dtype if into is not None else torch.float32)
        return into.copy_(y) if into is not None else y

    return launch


@pytest.mark.parametrize("m", [1, 63, 64, 65, 100, 128])
def test_row_blocks_give_the_rows_of_one_product(m):
    """in_row_blocks (qgemm's exact kernel past EXACT_MAX_M rows): launches of at most the
    limit (64 here), the last one short, each writing its own rows of one output; the rows are those of the
    whole product, into `out` where one is given (every element written: it starts as NaN)."""
    gen = torch.Generator().manual_seed(m)
    weight = torch.randn(24, 40, generator=gen)
    x = torch.randn(m, 40, generator=gen)
    calls: list = []
    y = in_row_blocks(_matmul_launch(weight, 64, calls), x, 64, None, 24, torch.float32)
    assert [c[0] for c in calls] == [min(64, m - r) for r in range(0, m, 64)]
    assert all(into for _, into in calls)
    assert torch.equal(y, torch.cat([x[r:r + 64] @ weight.t() for r in range(0, m, 64)]))
    out = torch.full((m, 24), float("nan"), dtype=torch.float16)
    assert in_row_blocks(_matmul_launch(weight, 64, []), x, 64, out, 24, torch.float16) is out
    assert not out.isnan().any() and torch.equal(out, y.half())


def test_a_launch_returning_elsewhere_is_copied_in():
    """A launch that returns a new tensor (a split-K finish) still lands in the output's rows,
    as does one given a block that is not contiguous (a column slice of a wider output)."""
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(2))

    def elsewhere(xb: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        return xb @ weight.t()

    y = in_row_blocks(elsewhere, x, 4, None, 8, torch.float32)
    assert torch.equal(y, torch.cat([x[r:r + 4] @ weight.t() for r in range(0, 10, 4)]))
    wide = torch.zeros(10, 12)
    calls: list = []
    in_row_blocks(_matmul_launch(weight, 4, calls), x, 4, wide[:, 2:10], 8, torch.float32)
    assert not any(into for _, into in calls)  # not contiguous: each launch wrote elsewhere
    assert torch.equal(wide[:, 2:10], y) and not wide[:, :2].any() and not wide[:, 10:].any()
