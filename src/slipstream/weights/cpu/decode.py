"""PackedDecodeLinear: a CPU linear held packed for decode (a few rows, bound by the bytes a
matvec reads) and dense for prefill (many rows, where the packed kernels are FLOP-bound), with
the fused forms a CPU decode step calls (norm then matmul, SwiGLU then matmul)."""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

from ...model.llama import gated
from ..linear import Linear
from .groups import finish


class PackedDecodeLinear(Linear):
    """A CPU linear held twice: packed (above) for calls of up to `max_rows` tokens (decode),
    where a matvec is bound by the bytes it reads (int4 reads a quarter of float16's), and
    dense for larger ones (prefill), where torch's packed CPU kernels are FLOP-bound and slower
    than a float32 GEMM.

    The packed copy is made at the first call that needs it, from GGUF bytes the caller copied
    at load (so the model file is not read again): packing costs about as much as the rest of
    the load, which the first token (a prefill) then does not wait for. Where `pack` returns
    None (no layout reads the format), decode stays dense. RAM: the packed copy on top of the
    dense weight, and the GGUF bytes until it is made.

    Decode on CPU is bound by per-op overhead as much as by the kernels (a 135M model's token
    is ~120 kernel calls and ~25 small ops a layer), so the block's fused forms go straight to
    the bfloat16 kernel: `norm_matmul` normalizes into bfloat16 in one op (`rms_norm_bf16`)
    and returns the kernel's bfloat16 output (the RoPE, the cache write and `glu_matmul` that
    consume it widen it exactly), and `glu_matmul` takes that bfloat16 [gate | up] as it is.
    Every op works row by row, so a row's bits never depend on the others in its call."""

    def __init__(self, dense: Linear, pack: Callable[[], Linear | None], max_rows: int,
                 packed_prefill: bool = False):
        """packed_prefill: calls of more than max_rows rows go to the packed copy's native
        kernel too (weights.cpu.kinds.PREFILL_KINDS), not to the dense weight, which is then
        never made (see `prefill`)."""
        self.dense = dense
        self.packed_prefill = packed_prefill
        self._pack: Callable[[], Linear | None] | None = pack
        self._packed: Linear | None = None
        # the load's prefetch thread (prefetch.prefetch_dense) may pack the head while a pass
        # asks for it: made once
        self._lock = threading.Lock()
        self.max_rows = max_rows
        # the packed copy's bare bfloat16 product (Int4PackLinear.kernel...) and its bias,
        # looked up once: each attribute lookup is a measurable share of a decode step
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._bias: torch.Tensor | None = None
        self._row: torch.Tensor | None = None  # norm_matmul's one-row bfloat16 input

    @classmethod
    def decode_only(cls, packed: Linear, max_rows: int, packed_prefill: bool = False
                    ) -> "PackedDecodeLinear":
        """A packed copy alone, with no dense weight behind it: a streamed layer's linear
        (weights.cpu_image), which serves calls of up to `max_rows` tokens exactly as a
        resident layer's PackedDecodeLinear does, and with `packed_prefill` larger calls as
        well (as a resident one with packed_prefill: the same kernel on the same bytes); a
        larger call without it is an error (the store builds such a layer's prefill copy
        from the GGUF file)."""
        lin = cls(_NoDense(packed.out_features, max_rows), lambda: packed, max_rows,
                  packed_prefill=packed_prefill)
        lin.packed  # noqa: B018 (the kernel and bias looked up now, not at the first call)
        return lin

    @property
    def out_features(self) -> int:
        return self.dense.out_features

    @property
    def is_packed(self) -> bool:
        """Whether the decode copy is made (or known not to exist), without making it."""
        return self._pack is None

    @property
    def packed(self) -> Linear:
        """The decode copy (made now if not yet; the dense weight where none can be)."""
        if self._pack is not None:
            with self._lock:
                if self._pack is not None:
                    packed = self._pack()
                    self._kernel = getattr(packed, "kernel", None)
                    self._bias = getattr(packed, "bias", None)
                    # the GGUF bytes go with the thunk
                    self._packed, self._pack = packed, None
        return self._packed if self._packed is not None else self.dense

    def adopt(self, packed: Linear | None) -> None:
        """Take `packed` as the decode copy instead of packing one (or over one made):
        the same layout read from a cached image (memory.resident_image). None: there is
        no packed copy (decode stays dense), as a thunk returning None says."""
        with self._lock:
            self._kernel = getattr(packed, "kernel", None)
            self._bias = getattr(packed, "bias", None)
            self._packed, self._pack = packed, None

    def _decode_kernel(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The bfloat16 product for a call of `rows` rows, or None (a prefill, or a packed
        copy without one: no layout)."""
        if rows > self.max_rows:
            return None
        if self._pack is not None:
            self.packed  # noqa: B018 (made at the first call that needs it)
        return self._kernel

    def one_row_kernel(self) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                      torch.Tensor | None] | None:
        """The bare bfloat16 product of a one-row call and the bias to add to it (float32, or
        None), for callers that fuse what surrounds it (model.cpu_native); None where decode
        has no packed kernel."""
        kernel = self._decode_kernel(1)
        return None if kernel is None else (kernel, self._bias)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        kernel = self._decode_kernel(x.shape[0])
        if kernel is None:
            if x.shape[0] <= self.max_rows:
                return self.packed(x, residual)
            return self.prefill(x, residual)
        return finish(kernel(x.to(torch.bfloat16)), x.dtype, self._bias, residual)

    def prefill(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A call of many rows: with packed_prefill, the packed copy's native kernel on float32
        rows (q4vnni, q8vnni, q6vnni: exact weights, 16-bit activations, each row's bits a
        decode token's whatever the rows beside it), else the dense weight. On the 2-core
        AVX-512 EPYC, 512 rows through a Qwen3-30B-A3B-shaped q/k/v (5120 x 2048, Q4_K) ran
        at ~30 GMAC/s on 2 busy threads against ~13 for the float16 weight widened into a
        float32 GEMM (load average 6.4; one idle thread: ~86 against 14-36)."""
        packed = self.packed if self.packed_prefill else None
        matvec = getattr(packed, "matvec", None)
        if matvec is None:
            return self.dense(x, residual)
        y = matvec(x.float().contiguous(), torch.empty(x.shape[0], packed.out_features))
        return finish(y, x.dtype, self._bias, residual)

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)); bfloat16 (plus a bias, float32) on the packed
        path."""
        kernel = self._decode_kernel(x.shape[0])
        if kernel is None:
            return super().norm_matmul(x, norm_weight, eps)
        if x.shape[0] == 1:  # decode: the normed row goes in a buffer kept for it
            if self._row is None:
                with torch.inference_mode(False):  # writable in and outside inference mode
                    self._row = torch.empty(x.shape, dtype=torch.bfloat16)
            y = kernel(rms_norm_bf16(x, norm_weight, eps, self._row))
        else:
            y = kernel(rms_norm_bf16(x, norm_weight, eps))
        return y if self._bias is None else torch.add(self._bias, y)

    def glu_matmul(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None,
                   act: str = "silu") -> torch.Tensor:
        """self(act(gate) * up) (+ residual); on the packed path the product is formed in
        gate_up's dtype (bfloat16 from `norm_matmul`), which the kernel reads anyway."""
        kernel = self._decode_kernel(gate_up.shape[0])
        if kernel is None:
            return super().glu_matmul(gate_up, residual, act)
        h = gated(act, gate_up)
        if h.dtype != torch.bfloat16:
            h = h.to(torch.bfloat16)
        return finish(kernel(h), gate_up.dtype if residual is None else residual.dtype,
                       self._bias, residual)


class _NoDense(Linear):
    """The dense side of a decode-only PackedDecodeLinear: there is none."""

    def __init__(self, out_features: int, max_rows: int):
        self.out_features = out_features
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError(f"a decode-only layer (packed weights alone) was called with "
                           f"{x.shape[0]} rows; it serves up to {self.max_rows}: passes of "
                           f"more tokens need the layer built with its dense weights")


_ZERO = torch.zeros(())


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x * rsqrt(mean(x^2) + eps) * weight) for float32 x (m, n), into `out` if
    given: the norm's scale is taken to the host (one small reduction) and the rest is one
    addcmul writing bfloat16, instead of F.rms_norm's chain of ops and a cast. Row by row
    (the one-row case is the same elementwise op), so each row's bits are those of a call of
    its own."""
    n = x.shape[-1]
    norms = torch.linalg.vector_norm(x, dim=-1)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16)
    if x.shape[0] == 1:  # float() of the one norm: a third of tolist()'s cost
        norm = float(norms)
        return torch.addcmul(_ZERO, x, weight, value=1.0 / math.sqrt(norm * norm / n + eps),
                             out=out)
    scales = [1.0 / math.sqrt(norm * norm / n + eps) for norm in norms.tolist()]
    for i, r in enumerate(scales):
        torch.addcmul(_ZERO, x[i], weight, value=r, out=out[i])
    return out
