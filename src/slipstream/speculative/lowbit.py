"""A low-bit copy of a model's layers: the speculative self-draft that SubSpec calls a
substitute. The layers whose reading bounds the target (those it streams on a GPU; every layer
on a CPU, which reads each one from RAM every token) are requantized at load to a coarse format
(Q2_K, say) and kept resident; the draft runs the target's own resident layers, embedding,
head and norms around them, and writes its guesses into the target's KV cache (runtime.engine
`self_draft(share_kv=True)`), so its prefix is the target's exact keys and values.

The copy is built through the loader's LayerBuilder from a TensorSource that re-encodes each
matrix on the fly (dequantized by slipstream's decoders, encoded by quant.encode), so a copied
layer is the same kind of object as any other layer of its device: the same kernels run it.
Rows that are not whole blocks of the chosen type (K-quants need 256 columns; the default
model's are 576 wide) take a 32-element fallback (Q4_0), as llama.cpp's quantizer falls back.

Encoding runs at ~20 ns an element on one core (numpy, which holds the GIL enough that two
threads gain ~1.2x): a second for the default model in-process; a copy of more than
POOL_MIN_ELEMENTS weights is encoded by a pool of worker processes, a few layers ahead of the
builds (a 70B's 80 layers are ~23 minutes of one core).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from typing import Callable, Collection

import numpy as np
import torch
from gguf import GGMLQuantizationType

from .. import quant
from ..modelfile.config import ModelConfig
from ..errors import BadArgument
from ..modelfile.gguf_file import GGUFFile, TensorInfo
from ..model.families import file_spec
from ..model.llama import LayerWeights
from ..precision import Precision
from ..quant.encode import encodable_types, quantize
from ..weights.linear import Workspace
from ..weights.loader import LayerBuilder, TensorSource, release_transients

# Copies this large are encoded by worker processes (spawned: a forked torch is not safe)
POOL_MIN_ELEMENTS = 1 << 30
# The type for rows that are not whole blocks of the chosen one (K-quants' 256)
FALLBACK = GGMLQuantizationType.Q4_0


def parse_lowbit_type(name: str | GGMLQuantizationType) -> GGMLQuantizationType:
    """'Q2_K' / 'q3_k' -> the type; BadArgument naming the encodable quantized types."""
    choices = {t.name: t for t in encodable_types() if get_bits(t) < 16}
    if isinstance(name, GGMLQuantizationType):
        name = name.name
    t = choices.get(str(name).upper())
    if t is None:
        raise BadArgument(f"cannot make a low-bit copy in {name!r}: slipstream encodes "
                          f"{', '.join(sorted(choices))}")
    return t


def get_bits(qtype: GGMLQuantizationType) -> float:
    """Bits per weight of a quantized type (its block's bytes over its elements)."""
    fmt = quant.get_format(qtype)
    return fmt.type_size * 8 / fmt.block_size


def copy_type(info: TensorInfo, qtype: GGMLQuantizationType) -> GGMLQuantizationType | None:
    """The type a tensor gets in the copy: `qtype`, or FALLBACK where its rows are not whole
    `qtype` blocks; None for tensors the copy keeps as they are (norms, biases, and rows that
    neither type can hold)."""
    if len(info.shape) != 2 or info.ggml_type == GGMLQuantizationType.F32:
        return None
    cols = int(info.shape[1])
    for t in (qtype, FALLBACK):
        if cols % quant.get_format(t).block_size == 0:
            return None if t == info.ggml_type else t
    return None


class RetypedFile:
    """What the planner's sizing functions read of a GGUFFile (architecture and tensor infos),
    with layer `layers`' matrices retyped as the copy stores them: memory.vram and memory.setup
    then size the copy's layers as they size any layer."""

    def __init__(self, gf: GGUFFile, qtype: GGMLQuantizationType, layers: Collection[int]):
        self.architecture = gf.architecture
        self.path = gf.path
        self.metadata = gf.metadata
        spec = file_spec(gf)
        self.tensors: dict[str, TensorInfo] = dict(gf.tensors)
        for i in layers:
            for name in spec.names(i, gf.tensors):
                info = gf.tensors[name]
                to = copy_type(info, qtype)
                if to is not None:
                    n_bytes = int(info.shape[0]) * quant.row_bytes(to, int(info.shape[1]))
                    self.tensors[name] = replace(info, ggml_type=to, n_bytes=n_bytes)


class RequantizedSource(TensorSource):
    """A TensorSource whose layer matrices are re-encoded in the copy's type when read (or
    taken from `encoded`, name -> bytes made ahead by worker processes)."""

    def __init__(self, gf: GGUFFile, qtype: GGMLQuantizationType):
        super().__init__(gf, private=True)
        self.qtype = qtype
        self.encoded: dict[str, "Future[np.ndarray]"] = {}

    def type_of(self, name: str):
        info = self.gf.tensors[name]
        return copy_type(info, self.qtype) or info.ggml_type

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        raw = super().raw(name, shape)
        info = self.gf.tensors[name]
        to = copy_type(info, self.qtype)
        if to is None:
            return raw.clone()  # a private copy: the draft never reads the file afterwards
        ahead = self.encoded.pop(name, None)
        if ahead is not None:
            return torch.from_numpy(ahead.result())
        return torch.from_numpy(_encode(raw, info.ggml_type, tuple(shape), to))


def _encode(raw: torch.Tensor, src_type, shape: tuple[int, ...], to) -> np.ndarray:
    dense = quant.dequantize(raw, src_type, shape).numpy()
    return np.ascontiguousarray(quantize(dense, to))


_WORKER_FILE: GGUFFile | None = None


def _worker_init(path: str) -> None:
    global _WORKER_FILE
    torch.set_num_threads(1)
    _WORKER_FILE = GGUFFile(path)


def _encode_in_worker(name: str, to: int) -> np.ndarray:
    info = _WORKER_FILE.tensors[name]
    raw = torch.from_numpy(np.asarray(_WORKER_FILE.tensor_bytes(name))).view(info.shape[0], -1)
    return _encode(raw, info.ggml_type, tuple(info.shape), GGMLQuantizationType(to))


def build_lowbit_layers(gf: GGUFFile, cfg: ModelConfig, device: torch.device,
                        precision: Precision, qtype: GGMLQuantizationType,
                        layers: Collection[int], workspace: Workspace | None = None,
                        progress: Callable[[int], None] | None = None,
                        workers: int | None = None) -> dict[int, LayerWeights]:
    """Layers `layers` of `gf` requantized to `qtype`, built for `device` as resident layers
    are (the target's `workspace` shared on CUDA). progress(1) after each layer. workers:
    encoding processes (None: one per core for a copy of more than POOL_MIN_ELEMENTS weights,
    else none; 0: none)."""
    order = sorted(layers)
    spec = file_spec(gf)
    todo = {i: [(n, copy_type(gf.tensors[n], qtype)) for n in spec.names(i, gf.tensors)]
            for i in order}
    todo = {i: [(n, t) for n, t in names if t is not None] for i, names in todo.items()}
    if workers is None:
        size = sum(gf.tensors[n].n_elements for names in todo.values() for n, _ in names)
        workers = (os.cpu_count() or 1) if size > POOL_MIN_ELEMENTS else 0
    builder = LayerBuilder(cfg, device, precision, workspace=workspace)
    src = RequantizedSource(gf, qtype)
    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init, initargs=(str(gf.path),))
    ahead = max(2, workers // 4)  # layers whose encoding is under way: bounds their RAM
    try:
        out: dict[int, LayerWeights] = {}
        for k, i in enumerate(order):
            if pool is not None:
                for j in order[k:k + ahead + 1]:
                    for name, to in todo[j]:
                        if name not in src.encoded and j not in out:
                            src.encoded[name] = pool.submit(_encode_in_worker, name, int(to))
            out[i] = builder.build(src, i)
            release_transients(device)
            if progress is not None:
                progress(1)
        return out
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
