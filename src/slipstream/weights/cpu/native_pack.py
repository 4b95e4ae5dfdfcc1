"""Load-time packing of GGUF rows in one native pass (native/int4_pack.c): 4-bit rows into
torch's int4 CPU layout (`pack_int4_rows`, for Int4PackLinear) and into q4vnni's codes and
float32 scale and zero planes (`q4vnni_native`, for Q4VnniLinear); Q8_0 rows into q8vnni's
whole records (`q8vnni_native`, for Q8VnniLinear).

Why: in torch ops the packing is a dozen small calls per 64 rows. On the H200 host, hybrid
decode's CPU share of a 70B (7.7 GB) took about 100 s that way on a pool of 15 threads, against
23 s for the whole load without it.

torch's layout depends on the CPU it runs on (blocks of 64 rows with AVX-512, 32 with AVX2):
torch_kernels.native_block checks the native packer against torch's own once per process.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from ... import native
from ...quant import get_format
from .groups import INT4_GROUP, Q4V_CODE_BYTES, Q4V_ROWS

FORMATS = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q4_K: 2}  # int4_pack.c's FMT_* codes
# a q8vnni record: 16 rows' 32 one-byte codes, then their 16 float16 scales
Q8V_RECORD_BYTES = 2 * Q4V_CODE_BYTES + 2 * Q4V_ROWS
BLOCKS = (64, 32)  # torch's row blocks: AVX-512, AVX2


def pack_int4_rows(raws, qtypes, shapes, block: int, threads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' rows stacked in torch's int4 layout for `block`-row blocks (what
    torch_kernels.int4pack_torch makes there), by int4_pack.c on `threads` OpenMP threads."""
    lib = native.library()
    rows, cols = sum(r for r, _ in shapes), shapes[0][1]
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scale_zeros = torch.empty(cols // INT4_GROUP, rows, 2, dtype=torch.bfloat16)
    row0 = 0
    for raw, qtype, (r, c) in zip(raws, qtypes, shapes):
        raw = _rows_of(raw, qtype, r, c, cols)
        lib.ss_int4pack_rows(raw.data_ptr(), raw.shape[1], FORMATS[Q(int(qtype))], r, cols,
                             row0, rows, block, packed.data_ptr(), scale_zeros.data_ptr(),
                             threads)
        row0 += r
    return packed, scale_zeros


def random_matrix(qtype: Q, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF bytes of a (rows, cols) matrix whose float16 fields are finite: random
    codes, scales and mins, with some zero and negative scales."""
    fmt = get_format(qtype)
    raw = torch.randint(0, 256, (rows * cols // fmt.block_size, fmt.type_size),
                        dtype=torch.uint8, generator=gen)
    halves = 2 if qtype in (Q.Q4_1, Q.Q4_K) else 1  # d (and m / dmin) at the block's start
    f16 = (torch.randn(raw.shape[0], halves, generator=gen) * 0.05).half()
    f16[::7, 0] = 0.0
    raw[:, :2 * halves] = f16.view(torch.uint8).reshape(raw.shape[0], 2 * halves)
    return raw.reshape(rows, -1)


def q4vnni_native(raws, qtypes, shapes, padded_rows: int, threads: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The stacked parts' q4vnni codes (padded_rows / 16, cols / 32, 256) uint8 and their
    float32 scales and zeros (padded_rows, cols / 32), made by int4_pack.c's ss_q4vnni_rows:
    the bits of vnni.py's torch path (q4vnni_codes of q4vnni_params), with padding rows
    0. None where the library is not there or a part is not Q4_0, Q4_1 or Q4_K. threads:
    OpenMP threads (default torch's count for this thread: 1 inside a pool that set it so)."""
    lib = native.library()
    if lib is None or any(Q(int(t)) not in FORMATS for t in qtypes):
        return None
    cols = shapes[0][1]
    groups = cols // INT4_GROUP
    codes = torch.zeros(padded_rows // Q4V_ROWS, groups, Q4V_CODE_BYTES, dtype=torch.uint8)
    scales = torch.zeros(padded_rows, groups)
    zeros = torch.zeros(padded_rows, groups)
    row0 = 0
    for raw, qtype, (r, c) in zip(raws, qtypes, shapes):
        raw = _rows_of(raw, qtype, r, c, cols)
        lib.ss_q4vnni_rows(raw.data_ptr(), raw.shape[1], FORMATS[Q(int(qtype))], r, cols, row0,
                           codes.data_ptr(), Q4V_CODE_BYTES, scales.data_ptr(), zeros.data_ptr(),
                           threads or torch.get_num_threads())
        row0 += r
    return codes, scales, zeros


def _rows_of(raw: torch.Tensor, qtype, rows: int, c: int, cols: int) -> torch.Tensor:
    """A part's GGUF bytes as contiguous (rows, row_bytes) uint8, checked."""
    if c != cols:
        raise ValueError(f"parts of one packed linear need one width, not {c} and {cols}")
    raw = raw.reshape(rows, -1).contiguous()
    if raw.dtype != torch.uint8 or raw.shape[1] != get_format(Q(int(qtype))).row_bytes(c):
        raise ValueError(f"{Q(int(qtype)).name} rows of {c} columns are "
                         f"{get_format(Q(int(qtype))).row_bytes(c)} uint8 bytes, not "
                         f"{tuple(raw.shape)} {raw.dtype}")
    return raw


def q8vnni_native(raws, shapes, padded_rows: int, threads: int | None = None
                  ) -> torch.Tensor | None:
    """The stacked Q8_0 parts as q8vnni records, (padded_rows / 16, cols / 32, 544) uint8,
    made by int4_pack.c's ss_q8vnni_rows: the bytes of vnni.py's torch path (q8vnni_codes of
    q + 128, then the float16 scales), padding rows 0. None where the library is not there.
    threads: OpenMP threads (default torch's count for this thread)."""
    lib = native.library()
    if lib is None:
        return None
    cols = shapes[0][1]
    # every byte of a real row is written below; only a last block's padding rows need zeros
    # (the head's 28 MiB memset is a fifth of its packing)
    packed = torch.empty(padded_rows // Q4V_ROWS, cols // INT4_GROUP, Q8V_RECORD_BYTES,
                         dtype=torch.uint8)
    if sum(r for r, _ in shapes) != padded_rows:
        packed[-1].zero_()
    row0 = 0
    for raw, (r, c) in zip(raws, shapes):
        raw = _rows_of(raw, Q.Q8_0, r, c, cols)
        lib.ss_q8vnni_rows(raw.data_ptr(), raw.shape[1], r, cols, row0, packed.data_ptr(),
                           threads or torch.get_num_threads())
        row0 += r
    return packed
