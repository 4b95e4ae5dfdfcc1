"""Rows of a table in pinned host memory, gathered by the GPU: `gather_host_rows(table, ids)`
reads the rows that device-resident ids name straight from host memory (unified addressing:
pinned memory is the GPU's to read over PCIe), in stream order.

A streamed model keeps its token embedding on the host (weights.linear.QuantEmbedding): a
0.4-0.9 GiB table of which a decode step needs one row. Indexing it on the host needs the ids
there, and so a copy that waits for every kernel before it: each decode step then starts only
once the last one has finished, the GPU idles while the host enqueues the first layers, and
generation's one step of look-ahead (runtime.generate) cannot happen. Read by the GPU, the
lookup is one more kernel in the stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _gather_kernel(table_ptr, ids_ptr, out_ptr, row_bytes, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(ids_ptr + r).to(tl.int64)
    for start in range(0, row_bytes, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < row_bytes
        b = tl.load(table_ptr + row * row_bytes + o, mask=m)
        tl.store(out_ptr + r * row_bytes + o, b, mask=m)


def gather_host_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] for a (rows, row_bytes) uint8 table in pinned host memory and int ids on a
    CUDA device: a (len(ids), row_bytes) uint8 tensor on the ids' device, with no host sync."""
    if table.dtype != torch.uint8 or table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"the table must be a contiguous (rows, bytes) uint8 tensor, not "
                         f"{table.dtype} {tuple(table.shape)}")
    ids = ids.reshape(-1).contiguous()
    out = torch.empty(ids.shape[0], table.shape[1], dtype=torch.uint8, device=ids.device)
    if ids.shape[0]:
        _gather_kernel[(ids.shape[0],)](table, ids, out, table.shape[1], BLOCK=BLOCK,
                                        num_warps=4)
    return out
