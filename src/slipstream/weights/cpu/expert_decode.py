"""A decode token's routed experts in one native call (native/moe_ffn.c): the one-token sum
(model.moe.OneTokenSum) the loader gives a CPU mixture of experts at precision "fast".

Where every expert of the token has its packed decode copies in the native layouts (gate/up
q4vnni, q8vnni, cb4 or iq, down q4vnni, q8vnni, q6vnni, cb4 or iq), the k experts are one call: one
OpenMP region whose threads take whole experts, float32 between the matvecs, each linear's
float32 bias (gpt-oss's) added to its output and the gated product formed in C
(native/decode_ops.c ss_glu_f32: SwiGLU, GeGLU's tanh form (Gemma 4), or gpt-oss's clamped
SwiGLU). Else (torch's layouts, dense weights) model.moe.expert_sum's loop, op by op.

What the one call's bits are. native_expert_ffn, an expert's rows through the same packed
kernels, the same ss_glu_f32 and the biases added as torch.add(bias, y) adds them, gives each
row the bits the one call gives that expert, and summing its outputs in the same order
(`out += y * w`, float32) gives the one call's sum bit for bit: the same operations in the same
order on the same float32 values. The op-by-op loop (expert_sum over PackedDecodeLinear's
calls) rounds the gate/up output, the gated product and the expert's output to bfloat16 at the
kernels, and model.moe.swiglu_oai and torch's gelu take their exponential from torch rather
than from ss_glu_f32's (about 2 float32 ulps, Cephes' expf), so against the loop the one call
is bounded, not equal: closer to the float64 sum of gguf-py's dequantized weights
(tests/model/test_moe_cpu_decode.py, tests/model/test_glu_expert_sum.py).

On the 2-core AVX-512 EPYC a Qwen3-30B-A3B-shaped layer's 8 experts took ~100 torch ops and
16 OpenMP regions a token through the loop.
A gpt-oss-20b-shaped MXFP4 file cut to 8 layers decoded
(tg16, 2 threads, load average 1.4 to 1.6, medians of 3 alternating rounds) at 19.5 tok/s in
one call against 16.4 through the loop (llama.cpp 20.4), and prefilled 16 tokens at 25.8
against 12.4 (the rows path, float32 between the packed kernels).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Sequence

import torch

from ... import native
from ...model.moe import expert_ffn, expert_sum
from .decode import PackedDecodeLinear
from .codebook import Cb4Linear
from .iquant import IqLinear
from .q6vnni import Q6VnniLinear
from .vnni import Q4VnniLinear


class _Expert(ctypes.Structure):
    """moe_ffn.c's moe_expert."""
    _fields_ = [("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("layouts", ctypes.c_int64), ("gate_up_bias", ctypes.c_void_p),
                ("down_bias", ctypes.c_void_p)]


# decode_ops.c's ss_glu_f32 `act` of each of model.moe's expert activations
GLU_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


# moe_ffn.c's layout bits: a gate/up or down that is not a q4_matvec.c weight
DOWN_Q6, GATE_UP_CB4, DOWN_CB4, GATE_UP_IQ, DOWN_IQ = 1, 2, 4, 8, 16
_GATE_UP = (Q4VnniLinear, Cb4Linear, IqLinear)
_DOWN = (Q4VnniLinear, Q6VnniLinear, Cb4Linear, IqLinear)


# an expert's descriptor, made once per gate/up linear (None: no native form), kept while the
# linear lives (a cold expert's go with it)
_DESCRIPTORS: "weakref.WeakKeyDictionary[object, _Expert | None]" = weakref.WeakKeyDictionary()


def expert_descriptor(gate_up, down) -> _Expert | None:
    """moe_ffn.c's descriptor of the expert (gate_up, down), made once and kept as long as
    gate_up; None where the expert has no native form (see the module doc)."""
    desc = _DESCRIPTORS.get(gate_up, False)
    if desc is not False:
        return desc
    desc = None
    if isinstance(gate_up, PackedDecodeLinear) and isinstance(down, PackedDecodeLinear):
        gu, dn = gate_up.packed, down.packed
        if (isinstance(gu, _GATE_UP) and isinstance(dn, _DOWN)
                and gu.out_features == 2 * dn.in_features
                and _bias_fits(gu.bias, gu.out_features)
                and _bias_fits(dn.bias, dn.out_features)):
            layouts = (DOWN_Q6 * isinstance(dn, Q6VnniLinear)
                       | GATE_UP_CB4 * isinstance(gu, Cb4Linear)
                       | DOWN_CB4 * isinstance(dn, Cb4Linear)
                       | GATE_UP_IQ * isinstance(gu, IqLinear)
                       | DOWN_IQ * isinstance(dn, IqLinear))
            desc = _Expert(gu.desc, dn.desc, layouts, _address(gu.bias), _address(dn.bias))
            # the descriptors' and the biases' memory lives as long as this
            desc._keep = (gu, dn, gu.bias, dn.bias)
    _DESCRIPTORS[gate_up] = desc
    return desc


def _bias_fits(bias: torch.Tensor | None, n: int) -> bool:
    """Whether moe_ffn.c reads `bias` as it is: none, or n contiguous float32 on the CPU (the
    loader's: weights.cpu.groups.concat_bias, or a row of the layer's (n_experts, rows) bias)."""
    return bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                            and bias.device.type == "cpu" and tuple(bias.shape) == (n,))


def _address(bias: torch.Tensor | None) -> int | None:
    return None if bias is None else bias.data_ptr()


def native_expert_sum(pairs: Sequence[tuple[object, object]], weights: torch.Tensor,
                      h: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """model.moe.expert_sum's sum for one row h, in one native call where every pair has the
    native packed form (see the module doc), else expert_sum itself."""
    lib = native.library()
    if act not in GLU_ACTS or lib is None or h.shape[0] != 1 or h.device.type != "cpu":
        return expert_sum(pairs, weights, h, act)
    descs = [expert_descriptor(g, d) for g, d in pairs]
    if any(d is None for d in descs):
        return expert_sum(pairs, weights, h, act)
    k = len(descs)
    table = (ctypes.c_void_p * k)(*(ctypes.addressof(d) for d in descs))
    x = h.float().contiguous()
    w = weights.float().contiguous()
    out = torch.empty(h.shape, dtype=torch.float32)
    if lib.ss_moe_ffn(table, k, x.data_ptr(), w.data_ptr(), out.data_ptr(),
                      torch.get_num_threads(), GLU_ACTS[act]) != 0:
        raise MemoryError(f"the native expert sum could not allocate its scratch "
                          f"({k} experts)")
    return out


# how model.cpu_native_moe finds a resident bank's experts' descriptors, to sum them inside its
# one-call layer (the model's math does not import the weight formats)
native_expert_sum.expert_descriptor = expert_descriptor  # type: ignore[attr-defined]


def native_expert_ffn(gate_up, down, h: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """model.moe.expert_ffn for the rows h routed to one expert, however many: through its
    packed copies as native_expert_sum computes a token's (gate/up, its bias, the gated product
    and down, and its bias, in float32, the kernels row by row: each row's bits a decode
    token's), where it has the native form; else expert_ffn. Float32 (n, hidden).

    No row limit: a bank of resident experts mixes a prefill's rows in one native call
    (weights.cpu.expert_rows: each row's bits a decode token's, whatever the count), and a
    bank whose experts are read from the file (weights.expert_tiers) runs expert by expert
    here, so it must take the same kernels at any count to give the same bits. (Up to 256
    rows it did, and past that a dense weight made for the call: a tiny Qwen3-MoE test
    layer's output, 300 rows all routed to one expert, then differed from the resident
    bank's by up to 1.5e-2, or by 7.6e-6 through packed prefill, which rounds to bfloat16
    between gate/up and down.) The packed kernels are the faster ones there too: a
    Qwen3-30B-A3B gate/up (1536 x 2048, Q4_K) on one thread of the 2-core EPYC took 1.3 ms
    for 32 rows packed against 3.3 dense, 12.8 against 16.6 at 256."""
    lib = native.library()
    rows = h.shape[0]
    if act not in GLU_ACTS or lib is None or h.device.type != "cpu":
        return expert_ffn(gate_up, down, h, act)
    if expert_descriptor(gate_up, down) is None:
        return expert_ffn(gate_up, down, h, act)
    gu, dn = gate_up.packed, down.packed
    x = h.float().contiguous()
    mid = gu.matvec(x, torch.empty(rows, gu.out_features))
    prod = torch.empty(rows, dn.in_features)
    # the gate/up bias added in place, row by row, as moe_ffn.c adds it
    lib.ss_glu_f32(mid.data_ptr(), _address(gu.bias), rows, dn.in_features, GLU_ACTS[act],
                   prod.data_ptr())
    y = dn.matvec(prod, torch.empty(rows, dn.out_features))
    return y if dn.bias is None else torch.add(dn.bias, y)
