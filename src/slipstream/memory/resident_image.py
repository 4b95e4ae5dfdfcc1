"""A resident CPU model's packed decode copies, read from an image file cached beside the model.

A resident CPU layer at precision="fast" decodes through packed copies of its weights
(weights.cpu: q4vnni, q8vnni, torch's int4/int8 layouts), made from the GGUF bytes. Packing is
most of what a load costs: on a synthetic 1B (16 layers, 2048 wide, 128256-token head) on a
busy 2-core machine, load() took 3.3 s, then packing the layers 6.0 s and the Q6_K head 7.7 s
(Q4_K; Q8_0: 3.4 s and 4.1 s), every time the model was loaded. So the first load packs them and
writes them to `MODEL.slipstream-cpu-resident.KEY.img` (image_file.write_images: under the
file's flock, to a temporary name, fsynced, renamed, the index last), and every later load
maps that file (read-only, shared: two processes of one model share its page-cache pages) and
makes each linear's packed copy as views into it, packing nothing. The bytes are those the
packers made (weights.cpu_image.packed_image), so decode's bits are the same either way.

KEY is image_file.plan_key over the resident layers, with the head counted as layer n_layers:
"L0-16" for a whole 16-layer model. The index's identity covers the model file (size, mtime),
the CPU packing's version and torch's (image_file.cpu_identity, which also holds the int4
layout of this CPU and whether q4vnni is in use), the precision and this file's own version;
a change to any of them rebuilds the file. At load each span's sampled CRC (disk.fingerprint)
and the file's size and mtime are checked against the index: a truncated or rewritten image is
rebuilt, not computed with. (A sampled CRC sees damage in the pages it samples, not a lone flipped
byte elsewhere.) The map holds the file's inode: a rebuild renames a new file into place and
`slipstream rm` unlinks it, neither of which touches a running model; truncating the file in
place would (SIGBUS), as it would for any mapped file.

The image is an optimisation, not a requirement: where it cannot be written (no space, no
writable folder) the load warns and keeps the packed copies it made, and SLIPSTREAM_CPU_IMAGE=0
turns it off (the copies are then packed at the first decode step, as without an image).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress

from ..errors import BudgetTooSmall, ImageFileError, SlipstreamWarning
from ..model.llama import LayerWeights
from ..weights.cpu import PackedDecodeLinear
from ..weights.cpu_image import CpuLayerLayout, packed_image, packed_image_nbytes, packed_views
from .disk import fingerprint
from .image_file import _locked, _open_index, cpu_identity, image_paths, write_images

# SLIPSTREAM_CPU_IMAGE=auto writes and reads images for model files of this size and more.
# Below it, packing costs less than writing the image: the default model (98 MB, Q4_1) loaded
# in 0.28-0.34 s from its image or packing in memory alike, and its first load, writing the
# image, took 1.01 s; a 1B Q4_K (0.98 GB) packed for 6-18 s, and loaded in 1.6-2.8 s from it
# (2-core machine under load 3-6)
AUTO_MIN_MODEL_BYTES = 256 << 20
RESIDENT_FORMAT_VERSION = 4  # bump when packed_image's entries or this file's keys change
KIND = "slipstream-cpu-resident"  # MODEL.KIND.KEY.img (hub.store.written_beside: rm)


@dataclass
class ResidentImage:
    """The mapped image a model's packed copies are views of (kept with the weights)."""

    path: Path
    ids: list[int]  # the layers it holds, the head as n_layers
    buffer: torch.Tensor  # uint8 over the whole map


def resident_linears(layers: list[LayerWeights | None], head, n_layers: int
                     ) -> dict[int, dict[str, PackedDecodeLinear]]:
    """The packed-decode linears of the resident layers (by field) and of the head (as layer
    n_layers, field "output"): what the image holds. Layers without any are left out."""
    groups: dict[int, dict[str, PackedDecodeLinear]] = {}
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        lins = {f.name: getattr(layer, f.name) for f in dataclasses.fields(LayerWeights)
                if isinstance(getattr(layer, f.name), PackedDecodeLinear)}
        if lins:
            groups[i] = lins
    if isinstance(head, PackedDecodeLinear):
        groups[n_layers] = {"output": head}
    return groups


def identity(model: Path, precision) -> dict:
    return {**cpu_identity(model), "resident": RESIDENT_FORMAT_VERSION,
            "precision": precision.name}


def _fits(layout: CpuLayerLayout, lins: dict[str, PackedDecodeLinear]) -> bool:
    """Whether an image's layout is of these linears: the same names and output rows."""
    return set(layout.linears) == set(lins) and all(
        layout.linears[n][1] == lin.out_features for n, lin in lins.items())


def open_resident(model: Path, groups: dict[int, dict[str, PackedDecodeLinear]],
                  ident: dict) -> tuple[ResidentImage, dict[int, dict[str, object]]] | None:
    """The cached image of `groups`, mapped and checked, with each layer's packed linears as
    views into it (None for one without a packed copy); None where the image is missing,
    stale or damaged."""
    ids = sorted(groups)
    data, index = image_paths(model, KIND, layers=ids)
    try:
        fd = os.open(data, os.O_RDONLY)
    except OSError:
        return None
    try:
        img = _open_index(data, index, ident, ids, CpuLayerLayout.from_json)
        st, now = os.fstat(fd), data.stat()
        # the file opened is the one the index was checked against (not replaced between)
        if img is None or (st.st_ino, st.st_size, st.st_mtime_ns) != \
                (now.st_ino, now.st_size, now.st_mtime_ns):
            return None
        if not all(_fits(img.layouts[i], groups[i]) for i in ids):
            return None
        # populated now (a read of the page cache), not one page fault at a time in the first
        # decode step; read-only and shared, so the pages are the page cache's, not copies
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    with memoryview(mm) as view:
        damaged = any(img.fingerprints.get(i) != fingerprint(view, s, e - s)
                      for i, (s, e) in img.spans.items())
    if damaged:  # changed after it was written: rebuilt by the caller
        mm.close()
        return None
    with warnings.catch_warnings():
        # a read-only map, as the GGUF file's (weights.loader.raw_tensor): nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
    try:
        made = {i: packed_views(img.layouts[i], buf[img.spans[i][0]:img.spans[i][1]])
                for i in ids}
    except (ValueError, KeyError, RuntimeError):  # a kind or plane this build does not read
        return None
    return ResidentImage(data, ids, buf), made


def image_wanted(model: Path, mode: str | bool) -> bool:
    """Whether SLIPSTREAM_CPU_IMAGE's `mode` (auto, True, False) gives `model` an image."""
    if mode == "auto":
        return model.stat().st_size >= AUTO_MIN_MODEL_BYTES
    return bool(mode)


def attach_resident_image(gf, layers: list[LayerWeights | None], head, n_layers: int,
                          precision, progress: bool = False) -> ResidentImage | None:
    """Give the resident layers' and the head's PackedDecodeLinears their packed copies from
    the cached image, writing it first where it is missing or stale (packing each linear
    once, as its first decode step would). None where nothing packs, or the image could not
    be written (a SlipstreamWarning says why; the copies made stay in memory)."""
    groups = resident_linears(layers, head, n_layers)
    if not groups:
        return None
    model = Path(gf.path)
    ident = identity(model, precision)
    opened = open_resident(model, groups, ident)
    if opened is None:
        ids = sorted(groups)
        data, index = image_paths(model, KIND, layers=ids)
        try:
            with _locked(data):
                opened = open_resident(model, groups, ident)  # written while this one waited?
                if opened is None:
                    sizes = [0] * (max(ids) + 1)
                    with Progress("[progress.description]{task.description}", BarColumn(),
                                  MofNCompleteColumn(), transient=True,
                                  disable=not progress) as bar:
                        task = bar.add_task("packing layers for the CPU (once: kept beside "
                                            "the model)", total=len(ids))
                        for i in ids:  # packs each linear now (kept: the model needs it)
                            sizes[i] = packed_image_nbytes(groups[i])
                            bar.advance(task)

                    def make(i: int) -> tuple[torch.Tensor, dict]:
                        host, layout = packed_image(groups[i])
                        return host, layout.to_json()

                    write_images(data, index, ident, ids, sizes, make,
                                 "writing packed layers for the CPU", progress,
                                 checksums=True, keep_cached=True)
                    opened = open_resident(model, groups, ident)
        except (ImageFileError, BudgetTooSmall, TypeError) as e:
            # TypeError: a packed layout weights.cpu_image cannot lay out (a new kind)
            warnings.warn(f"the packed decode copies of {model.name} stay unsaved, so the next "
                          f"load packs them again: {e}", SlipstreamWarning, stacklevel=2)
            return None
        if opened is None:
            warnings.warn(f"the packed decode image {data} could not be read back after it "
                          f"was written; the copies made now are used", SlipstreamWarning,
                          stacklevel=2)
            return None
    image, made = opened
    for i, lins in groups.items():
        for name, lin in lins.items():
            lin.adopt(made[i][name])
    return image
