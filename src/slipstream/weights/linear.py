"""Linear layers and the embedding, as callables the model math uses without knowing formats."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from .. import kernels, quant
from ..quant.native import dequantize_widened
from ..kernels.pack import f16_scales, fuse_scales
from ..model.llama import gated, rms_norm

# Row counts up to this go through the storage dtype directly (a memory-bound GEMV, where
# fewer bytes win); larger batches upcast the weight to the activation dtype once per call,
# because half-precision GEMM on CPU is far slower than float32 GEMM.
GEMV_MAX_ROWS = 8


# upcast(): weights up to this many elements are widened into a buffer kept per thread (32 MiB
# of float32 at most); a larger one (an output head) into a new tensor, as before
UPCAST_KEPT_MAX = 1 << 23
_upcast_buffers = threading.local()


def kept_buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
    """n elements of `dtype` from the buffer this thread keeps for upcast (UPCAST_KEPT_MAX at
    most): valid until the thread's next call."""
    kept: dict[torch.dtype, torch.Tensor] = _upcast_buffers.__dict__.setdefault("kept", {})
    buf = kept.get(dtype)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # writable in and outside inference mode
            buf = kept[dtype] = torch.empty(n, dtype=dtype)
    return buf[:n]


def upcast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight.to(dtype), for a CPU prefill's GEMM, widened into a buffer this thread keeps:
    valid until the thread's next call. A new tensor of a few MiB per matmul came back from
    the allocator as fresh pages each time, and faulting them in cost 18 times the conversion
    (1.3 ms against 0.07 for a 1536 x 576 weight on a 2-core machine): a third of a 31-token
    prefill of the default model. The same bits as weight.to(dtype)."""
    n = weight.numel()
    if weight.device.type != "cpu" or n > UPCAST_KEPT_MAX or weight.dtype == dtype:
        return weight.to(dtype)
    return kept_buffer(n, dtype).view(weight.shape).copy_(weight)


class Linear(ABC):
    """What the model math calls a linear layer: y = x @ W^T (+ b) (+ residual), the weight
    held in the subclass's own format. The block also calls the two fused forms below on any
    linear; their defaults are the plain composition, and a subclass overrides them where one
    kernel does the pair (QuantLinear with int8 activations)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, in) -> (T, out); with `residual`, residual + that (GPU kernels fold the add
        into the matmul's epilogue)."""

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps))."""
        return self(rms_norm(x, norm_weight, eps))

    def glu_matmul(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None,
                   act: str = "silu") -> torch.Tensor:
        """self(act(gate) * up) (+ residual) for gate_up = [gate | up]: the gated FFN's down
        projection (act "silu": SwiGLU; "gelu_tanh": GeGLU)."""
        return self(gated(act, gate_up), residual)


class DenseLinear(Linear):
    """y = x @ W^T (+ b) with W held dense in `weight.dtype`.

    On CPU the weight is stored as float16: dequantized GGUF values round to it with a relative
    error near 5e-4, it halves the bytes each decode step streams from RAM against float32, and
    torch's CPU fp16 GEMV accumulates in float32. Prefill upcasts to float32 for MKL's SGEMM.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # (out, in)
        self.bias = bias  # (out,) float32 or None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @staticmethod
    def fuse(parts: list["DenseLinear"]) -> tuple["DenseLinear", list["DenseLinear"]]:
        """Concatenate output rows into one layer; the parts become views into it, so the
        fused copy costs no extra memory."""
        weight = torch.cat([p.weight for p in parts])
        has_bias = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias if p.bias is not None else
                          torch.zeros(p.out_features, device=weight.device) for p in parts]
                         ) if has_bias else None
        views, row = [], 0
        for p in parts:
            n = p.out_features
            views.append(DenseLinear(weight[row:row + n],
                                     bias[row:row + n] if bias is not None else None))
            row += n
        return DenseLinear(weight, bias), views

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ b) (+ residual). For a few rows the product stays in the storage dtype:
        the next op (the residual add, SiLU, RoPE in float32) promotes it anyway, and every
        skipped cast is one fewer op in an overhead-bound decode step."""
        if x.shape[0] == 1:  # matrix-vector: torch's gemv path beats a 1-row gemm on CPU
            y = torch.mv(self.weight, x[0].to(self.weight.dtype)).unsqueeze(0)
        elif x.shape[0] <= GEMV_MAX_ROWS or self.weight.device.type != "cpu":
            y = F.linear(x.to(self.weight.dtype), self.weight)
        else:
            y = F.linear(x, upcast(self.weight, x.dtype))
        if self.bias is not None:
            y = y + self.bias
        if residual is not None:
            y = residual + y
        return y


class LazyDenseLinear(DenseLinear):
    """DenseLinear whose weight is made at its first use, from a thunk over GGUF bytes it
    holds (quant.dequantize_as, as the loader made it eagerly before: the same bits), and
    kept. A CPU model's dense weights serve only passes of more than GEMV_MAX_ROWS rows
    (prefill; decode reads the packed copies), so making them at load cost the load most of
    its time: on the default model (135M, Q4_1) dequantizing every layer to float16 took
    0.18 of a 0.68 s load on an idle 2-core machine, and 9.4 of 12.3 s on a busy one, for a
    `run` whose prompt might never need them: they are made after the load, by a thread
    (prefetch.prefetch_dense), or by the first pass that needs one first.

    `weight` reads like DenseLinear's attribute everywhere (the thunk runs on the first
    read); `materialized` says whether it has run, without running it. `fill`, where given,
    writes the same weight into a tensor the caller holds (`fuse` makes a fused weight so)."""

    def __init__(self, make: Callable[[], torch.Tensor], shape: tuple[int, int],
                 dtype: torch.dtype, bias: torch.Tensor | None = None,
                 fill: Callable[[torch.Tensor], object] | None = None):
        self._make: Callable[[], torch.Tensor] | None = make
        self._fill = fill
        self._weight: torch.Tensor | None = None
        self._lock = threading.Lock()  # the load's prefetch thread and a pass may both ask
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = dtype
        self.bias = bias
        self.of: LazyDenseLinear | None = None  # the fused weight a view (`fuse`) is rows of

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        if self._weight is None:
            with self._lock:
                if self._weight is None:
                    # the GGUF bytes go with the thunks
                    make, self._make, self._fill = self._make, None, None
                    assert make is not None
                    self._weight = make()
        return self._weight

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self._weight, self._make, self._fill = value, None, None

    @property
    def materialized(self) -> bool:
        return self._weight is not None

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @staticmethod
    def fuse(parts: list["DenseLinear"]) -> tuple["DenseLinear", list["DenseLinear"]]:
        """DenseLinear.fuse without making any weight now: the fused weight is the parts'
        weights concatenated at its first use (the same bytes), and the parts become lazy
        views into it. Parts that can fill a tensor (lazy_dense's) are dequantized straight
        into their rows of it: making each part and then concatenating them wrote q/k/v's and
        gate/up's weights twice, into fresh pages both times."""
        has_bias = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features)
                          for p in parts]) if has_bias else None
        rows = sum(p.out_features for p in parts)
        cols = parts[0].shape[1] if isinstance(parts[0], LazyDenseLinear) else \
            parts[0].weight.shape[1]
        dtype = parts[0].dtype if isinstance(parts[0], LazyDenseLinear) else \
            parts[0].weight.dtype
        fillers = [p._fill if isinstance(p, LazyDenseLinear) and not p.materialized else None
                   for p in parts]
        if all(f is not None for f in fillers):
            def make() -> torch.Tensor:
                out, row = torch.empty(rows, cols, dtype=dtype), 0
                for p, fill in zip(parts, fillers):
                    fill(out[row:row + p.out_features])
                    row += p.out_features
                return out
        else:
            def make() -> torch.Tensor:
                return torch.cat([p.weight for p in parts])
        fused = LazyDenseLinear(make, (rows, cols), dtype, bias)
        views, row = [], 0
        for p in parts:
            n = p.out_features
            view = LazyDenseLinear(lambda r=row, n=n: fused.weight[r:r + n], (n, cols), dtype,
                                   bias[row:row + n] if bias is not None else None)
            view.of = fused
            views.append(view)
            row += n
        return fused, views


def lazy_dense(raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int],
               dtype: torch.dtype, bias: torch.Tensor | None = None) -> LazyDenseLinear:
    """A LazyDenseLinear over `raw` (GGUF bytes, uint8 (rows, row_bytes)): the weight made
    as the loader's TensorSource.dense makes it, at its first use."""
    return LazyDenseLinear(lambda: quant.dequantize_as(raw, qtype, shape, dtype), shape, dtype,
                           bias, fill=lambda out: quant.dequantize_as(raw, qtype, shape, dtype,
                                                                      out=out))


class OnDemandDenseLinear(Linear):
    """DenseLinear over a weight it does not hold: its GGUF bytes are dequantized to `dtype`
    at each call (quant.dequantize_as, as the loader makes the dense weight), then multiplied
    as DenseLinear does, so each call gives DenseLinear's bits. For a weight that is seldom
    multiplied dense: a streamed CPU plan's head, which decodes through its packed copy and
    needs the dense weight only for all-logits passes of more than GEMV_MAX_ROWS rows; a
    mixture of experts' experts, whose dense copies would take 4 times their GGUF bytes at
    float16 (about 60 GB for Qwen3-30B-A3B) where only a pass's routed experts need one.

    `stacked` makes one over several parts' bytes (gate and up), their rows one after
    another, each dequantized into its rows of the weight (LazyDenseLinear.fuse's bits)."""

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType | int,
                 shape: tuple[int, int], dtype: torch.dtype, bias: torch.Tensor | None = None):
        self.parts = [(raw, qtype, (int(shape[0]), int(shape[1])))]  # private memory
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = dtype
        self.bias = bias

    @classmethod
    def stacked(cls, raws: list[torch.Tensor], qtypes: list, shapes: list[tuple[int, int]],
                dtype: torch.dtype, biases: list[torch.Tensor | None] | None = None
                ) -> "OnDemandDenseLinear":
        """The parts' rows as one linear (biases: one per part or None; zeros where a part
        has none, as DenseLinear.fuse)."""
        lin = cls(raws[0], qtypes[0], shapes[0], dtype)
        lin.parts = [(r, t, (int(s[0]), int(s[1]))) for r, t, s in zip(raws, qtypes, shapes)]
        lin.shape = (sum(int(s[0]) for s in shapes), int(shapes[0][1]))
        if biases is not None and any(b is not None for b in biases):
            lin.bias = torch.cat([b if b is not None else torch.zeros(s[0])
                                  for b, s in zip(biases, shapes)])
        return lin

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, made now and not kept (the caller's to drop)."""
        if len(self.parts) == 1:
            raw, qtype, shape = self.parts[0]
            return quant.dequantize_as(raw, qtype, shape, self.dtype)
        weight, row = torch.empty(self.shape, dtype=self.dtype), 0
        for raw, qtype, shape in self.parts:
            quant.dequantize_as(raw, qtype, shape, self.dtype, out=weight[row:row + shape[0]])
            row += shape[0]
        return weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > GEMV_MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32 \
                and self.dtype == torch.float16:
            w = self._widened()
            if w is not None:  # DenseLinear's float32 GEMM on its widened weight, as it does
                y = F.linear(x, w)
                if self.bias is not None:
                    y = y + self.bias
                return y if residual is None else residual + y
        return DenseLinear(self.weight, self.bias)(x, residual)

    def _widened(self) -> torch.Tensor | None:
        """The float16 weight widened to float32 (upcast's bits), made in one native pass
        per part into this thread's kept buffer (or a new tensor past UPCAST_KEPT_MAX), or
        None where the native pass does not serve. An expert's weights take one thread: a
        Qwen3-30B-A3B gate/up's 3.1M weights took 0.42 ms on one, and a two-thread region
        per expert waits for a descheduled thread on a shared machine."""
        n = self.shape[0] * self.shape[1]
        out = kept_buffer(n, torch.float32) if n <= UPCAST_KEPT_MAX else \
            torch.empty(n, dtype=torch.float32)
        out = out.view(self.shape)
        threads = 1 if n <= UPCAST_KEPT_MAX else torch.get_num_threads()
        row = 0
        for raw, qtype, shape in self.parts:
            if dequantize_widened(raw, qtype, shape, out[row:row + shape[0]], threads) is None:
                return None
            row += shape[0]
        return out


class QuantEmbedding:
    """Token embedding kept in its GGUF format: a lookup dequantizes only the rows it gathers.

    `device`: where the rows are dequantized and returned. The table may stay on the host
    (`raw` on CPU, the file's memory map) while the model computes on CUDA: a token needs one
    row of a table that is 0.4 GiB for an 8B, VRAM that a streamed model spends on layers
    instead. The rows then cross to the GPU as raw bytes and are dequantized there, as they
    would be from a GPU table, so both give the same numbers."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, hidden: int, out_dtype: torch.dtype,
                 device: torch.device | None = None, pinned: bool = False):
        """pinned: `raw` is a host table in pinned memory, which a CUDA `device` reads itself
        (kernels.gather_host_rows: no host sync per lookup; SLIPSTREAM_PINNED_EMBED)."""
        self.raw = raw  # (vocab, row_bytes) uint8
        self.ggml_type = ggml_type
        self.hidden = hidden
        self.out_dtype = out_dtype
        self.device = raw.device if device is None else device
        self.pinned = pinned and raw.device.type == "cpu" and self.device.type == "cuda"

    def on_device(self) -> "QuantEmbedding":
        """This table with its rows held where they are returned (a host table's VRAM copy)."""
        return QuantEmbedding(self.raw.to(self.device), self.ggml_type, self.hidden,
                              self.out_dtype, self.device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pinned and ids.device.type == "cuda":
            rows = kernels.gather_host_rows(self.raw, ids)  # the GPU reads the host's rows
        else:
            # a host table waits for the ids (one sync per step: streamed models only, which
            # run without CUDA graphs and spend milliseconds per layer on copies anyway)
            rows = self.raw[ids.to(self.raw.device)].to(self.device)
        if rows.device.type == "cpu":  # one native pass where the format has one: a CPU
            # prefill's 512 Q6_K rows took ~0.1 s of torch ops (quant.dequantize's bits)
            return quant.dequantize_as(rows, self.ggml_type, (ids.shape[0], self.hidden),
                                       self.out_dtype)
        return quant.dequantize(rows, self.ggml_type, (ids.shape[0], self.hidden)).to(
            self.out_dtype)


class Workspace:
    """What the QuantLinears on one device share: a flat scratch buffer (prefill dequantizes one
    weight at a time into it, so it is sized for the largest weight, not their sum), and the
    decode precision. With `int8_activations` (precision="fast"), decode GEMVs round x to int8
    per block of 32 and multiply codes with dp4a (kernels/gemv_q8.py: ~3x the fp32 kernel's
    bandwidth); without it (precision="exact") they run in fp32 on the exact weights, and with
    `float32_products` (precision="exact" too) so do the matmuls of more rows (QuantLinear).

    `max_elements` caps the scratch (LayerBuilder sets the largest layer weight): a weight
    larger than that, the output head in practice, is dequantized and multiplied in row chunks,
    so the head's full fp16 copy (1 GiB for a 128k vocabulary at 4096 wide) never takes VRAM
    that layers could use. Only prompts scored in full (logits of every token) use it."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float16,
                 int8_activations: bool = False, max_elements: int | None = None,
                 float32_products: bool = False):
        self.device = device
        self.dtype = dtype
        self.int8_activations = int8_activations
        self.float32_products = float32_products
        self.max_elements = max_elements
        self.buffer = torch.empty(0, device=device, dtype=dtype)

    def reserve(self, n_elements: int) -> None:
        if self.max_elements is not None:
            n_elements = min(n_elements, self.max_elements)
        if self.buffer.numel() < n_elements:
            self.buffer = torch.empty(n_elements, device=self.device, dtype=self.dtype)

    def rows_per_chunk(self, cols: int) -> int:
        """How many rows of a `cols`-wide weight one scratch holds (at least one)."""
        cap = self.buffer.numel() if self.max_elements is None else self.max_elements
        return max(1, cap // cols)

    def view(self, rows: int, cols: int) -> torch.Tensor:
        self.reserve(rows * cols)
        return self.buffer[: rows * cols].view(rows, cols)


# the float32 copy of a float weight's rows that one step of QuantLinear._float32_matmul makes
_FLOAT32_CHUNK_BYTES = 64 << 20

_FLOAT_TYPES = {int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16),
                int(GGMLQuantizationType.BF16)}


class QuantLinear(Linear):
    """y = x @ W^T (+ b) (+ residual) with W kept in its GGUF format, repacked once for the
    Triton kernels: a fused dequant-GEMV for up to 8 rows (float32 accumulation; x in int8 when
    the workspace says so), a fused dequant-GEMM on the tensor cores up to 128 (float16
    weights, as below), dequantize to float16 plus cuBLAS above that. float16 rather than
    bf16: GGUF scales are float16, so the dequantized weights keep 3 more mantissa bits, and
    activations after RMSNorm stay far inside its range."""

    def __init__(self, packed, bias: torch.Tensor | None, workspace: Workspace,
                 fuse: bool = True):
        """fuse (int8 activations only): fold the scales into one f16 plane (fast kernels,
        ~10 % more bytes); False keeps the GGUF layout and lets the kernels round the scales
        the same way (streamed layers, where bytes moved set the speed). Same results."""
        self.packed = packed
        self.bias = bias
        self.workspace = workspace
        self._matmul = kernels.matmul
        self._rms_norm = kernels.rms_norm
        self._qgemm, self._qgemm_max_m = kernels.qgemm, kernels.QGEMM_MAX_M
        self._q8 = None
        # codebook (IQ4_NL, IQ4_XS, MXFP4) and i-quant grid formats: their codes index a
        # grid, which the int8 GEMV and qgemm do not read; they take the float32 GEMV and
        # dequantize + cuBLAS
        self._grid = int(packed.qtype) not in _FLOAT_TYPES and not packed.spec.int_codes
        if workspace.int8_activations and int(packed.qtype) not in _FLOAT_TYPES \
                and not self._grid:
            from ..kernels import gemv_q8  # local: a Triton module (absent on CPU-only hosts)

            self.packed = packed = fuse_scales(packed) if fuse else f16_scales(packed)
            self._q8 = gemv_q8
        # float formats are multiplied as they are; quantized ones dequantize into scratch
        self._scratch = int(packed.qtype) not in _FLOAT_TYPES
        # rows the GEMVs take: the int8-activation GEMV hands over to qgemm from QGEMM_MIN_M
        # rows (its cost jumps at 8: 389 us against qgemm's 146 for gate_up 28672x4096 Q4_K
        # on the H200); the exact one keeps up to MAX_M (209 us against 209, and float32)
        self._max_m = kernels.QGEMM_MIN_M - 1 if self._q8 is not None else kernels.MAX_M
        # precision "exact": no float16 rounding above the GEMV's rows either
        self._float32 = workspace.float32_products and (
            not self._scratch or self._grid or kernels.qgemm_supports(packed))
        if self._scratch:
            workspace.reserve(packed.rows * packed.cols)

    @property
    def out_features(self) -> int:
        return self.packed.rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if m > self._max_m and self._float32:
            y = self._float32_matmul(x)
        elif m > self._max_m:
            # small batches (tree levels, verification): the fused quantized GEMM (the
            # scratch holds a streamed layer's fused scales for the call); prefill-sized
            # ones: dequantize into the scratch + cuBLAS
            if self._scratch and m <= self._qgemm_max_m and not self._grid:
                y = self._qgemm(x, self.packed, out_dtype=x.dtype,
                                scale_buffer=self.workspace.buffer)
            else:
                y = self._prefill_matmul(x)
        elif self._q8 is not None:
            return self._q8_matmul(self._q8.quantize_x(x), x.dtype, residual)
        else:
            y = self._matmul(x, self.packed, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if residual is not None:
            y = residual + y
        return y

    def _float32_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 values and sums, as the exact decode GEMV has: quantized weights through
        qgemm's float32 variant, QGEMM_MAX_M rows of x at a time (each reads the whole weight:
        precision "exact" is the reference, not the fast path); float weights through cuBLAS in
        float32, a row chunk of the weight at a time (the float32 copy stays small)."""
        x32 = x.float()
        if self._grid:  # no qgemm for these: float32 row chunks of the weight, then cuBLAS
            rows, cols = self.packed.rows, self.packed.cols
            chunk = max(1, _FLOAT32_CHUNK_BYTES // (4 * cols))
            y = torch.empty(x.shape[0], rows, device=x.device, dtype=x.dtype)
            for r0 in range(0, rows, chunk):
                part = self.packed.row_slice(r0, min(rows, r0 + chunk))
                y[:, r0:r0 + chunk] = x32 @ kernels.dequantize(part, torch.float32).t()
            return y
        if self._scratch:
            step = self._qgemm_max_m
            parts = [self._qgemm(x32[r:r + step], self.packed, out_dtype=x.dtype, exact=True)
                     for r in range(0, x32.shape[0], step)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        weight = self.packed.lo
        rows, cols = weight.shape
        chunk = max(1, _FLOAT32_CHUNK_BYTES // (4 * cols))
        y = torch.empty(x.shape[0], rows, device=x.device, dtype=x.dtype)
        for r0 in range(0, rows, chunk):
            y[:, r0:r0 + chunk] = x32 @ weight[r0:r0 + chunk].float().t()
        return y

    def _prefill_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize into the scratch, then cuBLAS; in row chunks where the weight is larger
        than the scratch (see Workspace)."""
        x16 = x.to(torch.float16)
        rows, cols = self.packed.rows, self.packed.cols
        if not self._scratch:
            return self._matmul(x16, self.packed, out_dtype=x.dtype)
        chunk = self.workspace.rows_per_chunk(cols)
        if rows <= chunk:
            return self._matmul(x16, self.packed, out_dtype=x.dtype,
                                scratch=self.workspace.view(rows, cols))
        y = torch.empty(x.shape[0], rows, device=x.device, dtype=x.dtype)
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            y[:, r0:r1] = self._matmul(x16, self.packed.row_slice(r0, r1), out_dtype=x.dtype,
                                       scratch=self.workspace.view(r1 - r0, cols))
        return y

    def _q8_matmul(self, xq_xm: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
                   residual: torch.Tensor | None) -> torch.Tensor:
        # the residual is added inside the kernel (one launch fewer), after the bias if any
        if self.bias is None:
            return self._q8.gemv_q8_quantized(*xq_xm, self.packed, out_dtype=dtype,
                                              residual=residual)
        y = self._q8.gemv_q8_quantized(*xq_xm, self.packed, out_dtype=dtype)
        y = y + self.bias.to(y.dtype)
        return y if residual is None else residual + y

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)); for decode with int8 activations the norm and
        the quantization of its output are one kernel."""
        if self._q8 is not None and x.shape[0] <= self._max_m:
            return self._q8_matmul(self._q8.rms_norm_q8(x, norm_weight, eps), x.dtype, None)
        return self(self._rms_norm(x, norm_weight, eps))

    def glu_matmul(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None,
                   act: str = "silu") -> torch.Tensor:
        """self(act(gate) * up) (+ residual) for gate_up = [gate | up]; for decode with int8
        activations the gated product is formed inside the quantizing kernel."""
        if self._q8 is not None and gate_up.shape[0] <= self._max_m:
            return self._q8_matmul(self._q8.quantize_x(gate_up, glu=True, act=act),
                                   gate_up.dtype, residual)
        return super().glu_matmul(gate_up, residual, act)
