"""Tier C on CUDA: the disk layers' repacked images, in a cache file next to the model.

The GGUF file holds raw blocks; the kernels want repacked planes (kernels/pack.py). A layer read
from disk every token could be repacked on the GPU after each copy, or repacked once at load and
stored as an image file. We store the image file. Reasoning, on the 70B Q4_K anchor (0.49 GB of
GGUF bytes per layer, 0.86 G weights; disk 2.3 GB/s, pinned H2D 55 GB/s, HBM ~4 TB/s):

- Repacking on the GPU per use: `pack_weight` is a chain of elementwise torch ops over int64
  codes, about six passes of 16 bytes per weight, ~80 GB of HBM traffic per layer: 20-40 ms plus
  a few thousand kernel launches, per layer and per prompt chunk. It also allocates int64
  temporaries of ~0.5 GB per 2048-row chunk (several live at once) on the hot path, 1-2 GB of
  VRAM outside any budget, and it would run on the compute stream or fight it for the SMs.
- Reading repacked images: the file is +2.8% bytes for Q4_K (+2.3% Q5_K, +3.6% Q3_K, 0% for
  Q6_K/Q8_0/legacy formats), so a layer's read takes ~6 ms longer at 2.3 GB/s, and the load pays
  one build (each disk layer packed once on the GPU, as tier B does) and one write: ~7 GB for
  the 70B with 24 GiB VRAM and 12 GiB RAM, next to a 40 GB model on a 64 GiB disk. In exchange
  the bytes on disk are exactly a slot's bytes: one O_DIRECT read into pinned staging, one
  host-to-device copy, views. The hot path, the code and the bits are tier B's.

The file is reused while the model file (size, mtime) and the image format are unchanged;
otherwise it is rebuilt. It lives next to the model, or in the slipstream cache directory where
the model's directory is not writable.

One file per plan: its name carries the layers it holds (`MODEL.slipstream.L40-79.img`, a hash
where they are not one run), so two processes whose budgets stream different layers of one model
never read or replace each other's file. A file is written under an exclusive flock on its
`.lock` file (a second process with the same plan waits, then reuses it), to a temporary name in
the same folder, fsynced, and renamed into place: no reader sees a partial file. A filesystem
failure on the way (a read-only folder, a full disk, a cache path under a file) is an
ImageFileError naming the path and what to do; the images are not optional for a plan that
counted on them (the packed CPU decode computes on their bytes), so nothing falls back silently.

CPU streaming keeps images too (`build_cpu_images`, weights.cpu_image: a layer packed for
torch's int4/int8 CPU kernels), in a file of their own (`MODEL.slipstream-cpu.img`) written by
the same code. Their index also records the torch version and a fingerprint of torch's int4
layout on this CPU (it depends on the CPU's vector width), and, per layer, the sampled CRC the
disk reader checks every read against (disk.fingerprint): an image changed after it was written
fails its first read with FileChanged instead of computing with other weights.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from rich.progress import BarColumn, DownloadColumn, Progress

from ..errors import BudgetTooSmall, ImageFileError, SlipstreamError
from ..hub.store import written_path
from ..weights.cpu_image import CpuLayerLayout, cpu_image_of, layout_fingerprint
from ..weights.image import LayerLayout, to_image
from ..weights.loader import LayerBuilder, TensorSource, release_transients
from .budget import fmt_bytes
from .disk import ALIGN, fingerprint

FORMAT_VERSION = 2  # bump when LayerLayout, to_image or pack_weight change their bytes
CPU_FORMAT_VERSION = 4  # bump when weights.cpu_image or weights.cpu change their bytes
SPACE_MARGIN = 1 << 30  # leave this much free on the disk after writing the file


@dataclass
class ImageFile:
    path: Path
    spans: dict[int, tuple[int, int]]  # layer -> [start, end) of its image in the file
    layouts: dict[int, Any]  # LayerLayout (CUDA) or weights.cpu_image.CpuLayerLayout
    # layer -> disk.fingerprint of its image as written (CPU images; empty for CUDA's), which
    # a reader is seeded with (DirectReader.expect) so its first read is checked too
    fingerprints: dict[int, int] = field(default_factory=dict)


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def plan_key(layers: Sequence[int]) -> str:
    """The part of an image file's name that says which layers it holds: "L3-29" for a run
    of layers (what a budget streams: the layers past those it keeps), else a hash of the
    list ("Hxxxxxxxxxxxx")."""
    ls = sorted({int(i) for i in layers})
    if not ls:
        raise ValueError("an image file holds at least one layer")
    if ls == list(range(ls[0], ls[-1] + 1)):
        return f"L{ls[0]}-{ls[-1]}"
    return "H" + hashlib.sha1(",".join(map(str, ls)).encode()).hexdigest()[:12]


def image_paths(model: Path, kind: str = "slipstream", *,
                layers: Sequence[int]) -> tuple[Path, Path]:
    """(data file, index file) of the images of `layers`, next to the model or in the cache
    (hub.store.written_path). `kind` names the file: "slipstream" (CUDA's images),
    "slipstream-cpu" (streamed CPU layers) or "slipstream-cpu-resident"
    (memory.resident_image)."""
    base = written_path(model, f"{kind}.{plan_key(layers)}")
    return base.with_name(base.name + ".img"), base.with_name(base.name + ".json")


def _fs_error(path: Path, e: OSError) -> ImageFileError:
    """One line for a filesystem failure while writing images at `path`, with what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = f"free space in {path.parent} or raise --ram-budget"
    else:
        todo = ("make the model's folder writable, or set SLIPSTREAM_CACHE to a writable "
                "folder (the images go there when the model's folder is not writable)")
    return ImageFileError(f"cannot write the layer images at {path}: "
                          f"{e.strerror or e}; {todo}")


@contextmanager
def _locked(data: Path) -> Iterator[None]:
    """An exclusive flock on `data`'s lock file while the block runs: one writer per plan's
    file at a time; a process with the same plan waits for the file, then reuses it. The lock
    file stays (removing it would let a third process lock a new inode while one waits on
    the old)."""
    lock = data.with_name(data.name.removesuffix(".img") + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _fs_error(lock, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _identity(model: Path, f16_scales: bool) -> dict:
    """What an image file depends on: the model file, the image format, and the precision
    (precision="fast" marks its weights to round scales to f16, kernels.pack.f16_scales;
    images are never fused, so the bytes are the same, only the layouts say so)."""
    st = model.stat()
    return {"version": FORMAT_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "f16_scales": f16_scales}


def open_images(model: Path, layers: list[int], f16_scales: bool = True) -> ImageFile | None:
    """The cached image file when it is current and holds `layers`, else None."""
    return _open_index(*image_paths(model, layers=layers), _identity(model, f16_scales),
                       layers, LayerLayout.from_json)


def _open_index(data: Path, index: Path, identity: dict, layers: list[int],
                parse: Callable[[dict], Any]) -> ImageFile | None:
    """The image file `index` describes, when it was written for `identity`, holds `layers`,
    and (where the index says) is still the file that was written (size and mtime); else
    None (to be rebuilt)."""
    try:
        doc = json.loads(index.read_text())
        if doc.get("model") != identity or not data.exists():
            return None
        written = doc.get("file")
        st = data.stat()
        if written is not None and [st.st_size, st.st_mtime_ns] != written:
            return None  # changed after it was written: rebuild it
        entries = {int(k): v for k, v in doc["layers"].items()}
        if not set(layers) <= set(entries):
            return None
        if st.st_size < max((entries[i]["end"] for i in layers), default=0):
            return None
        return ImageFile(data, {i: (entries[i]["start"], entries[i]["end"]) for i in layers},
                         {i: parse(entries[i]["layout"]) for i in layers},
                         {i: entries[i]["crc"] for i in layers if "crc" in entries[i]})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_space(directory: Path, needed: int, replaced: int = 0) -> None:
    free = shutil.disk_usage(directory).free + replaced
    if needed + SPACE_MARGIN > free:
        raise BudgetTooSmall(
            f"streaming from disk needs {fmt_bytes(needed)} of repacked layer images in "
            f"{directory}, but only {fmt_bytes(free)} is free there (keeping "
            f"{fmt_bytes(SPACE_MARGIN)} spare); free disk space or raise --ram-budget")


def build_images(gf, cfg, device: torch.device, precision, layers: list[int],
                 image_bytes: list[int], progress: bool = True, builder=None) -> ImageFile:
    """Reuse the cached image file for `layers`, or build each layer once on the GPU and write
    its image. `image_bytes` (the planner's per-layer sizes) sizes the disk-space check.
    `builder` (tests): a LayerBuilder that packs for the kernels on another device."""
    model = Path(gf.path)
    fast = precision.name == "fast"
    cached = open_images(model, layers, fast)
    if cached is not None:
        return cached
    data, index = image_paths(model, layers=layers)
    with _locked(data):
        if open_images(model, layers, fast) is None:  # not written while this one waited
            if builder is None:
                builder = LayerBuilder(cfg, device, precision, fuse_scales=False)

            def make(i: int) -> tuple[torch.Tensor, dict]:
                image = to_image(builder.build(TensorSource(gf), i), pin=False)
                release_transients(device)
                return image.host, image.layout.to_json()

            write_images(data, index, _identity(model, fast), layers, image_bytes, make,
                         "writing repacked disk layers", progress)
            builder = make = None  # the builder and its workspace go before what comes next
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = open_images(model, layers, fast)
    if result is None:
        raise SlipstreamError(f"the repacked layer images in {data} could not be read back")
    return result


def cpu_identity(model: Path) -> dict:
    """What a CPU image file depends on: the model file, the format, torch (its packers), and
    torch's int4 layout on this machine (weights.cpu_image.layout_fingerprint)."""
    st = model.stat()
    return {"version": CPU_FORMAT_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "torch": torch.__version__, "int4_layout": layout_fingerprint()}


def open_cpu_images(model: Path, layers: list[int]) -> ImageFile | None:
    """The cached CPU image file when it is current and holds `layers`, else None."""
    return _open_index(*image_paths(model, "slipstream-cpu", layers=layers),
                       cpu_identity(model), layers, CpuLayerLayout.from_json)


def build_cpu_images(gf, cfg, precision, layers: list[int], image_bytes: list[int],
                     progress: bool = True) -> ImageFile:
    """CPU streaming: reuse the cached CPU image file for `layers`, or pack each layer once
    for the CPU kernels (weights.cpu_image) and write its image. `image_bytes`: the planner's
    per-layer sizes (weights.cpu_image.image_nbytes), for the disk-space check."""
    model = Path(gf.path)
    cached = open_cpu_images(model, layers)
    if cached is not None:
        return cached

    def make(i: int) -> tuple[torch.Tensor, dict]:
        host, layout = cpu_image_of(gf, cfg, precision, i)
        return host, layout.to_json()

    data, index = image_paths(model, "slipstream-cpu", layers=layers)
    with _locked(data):
        if open_cpu_images(model, layers) is None:  # not written while this one waited
            write_images(data, index, cpu_identity(model), layers, image_bytes, make,
                         "packing streamed layers for the CPU", progress, checksums=True)
    result = open_cpu_images(model, layers)
    if result is None:
        raise SlipstreamError(f"the packed layer images in {data} could not be read back")
    return result


def _replace_durably(tmp: Path, dest: Path) -> None:
    """Rename `tmp` (written and fsynced) over `dest`, then fsync the folder so the rename
    itself survives a crash."""
    os.replace(tmp, dest)
    dfd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_images(data: Path, index: Path, identity: dict, layers: list[int],
                 image_bytes: list[int], make: Callable[[int], tuple[torch.Tensor, dict]],
                 what: str, progress: bool, checksums: bool = False,
                 keep_cached: bool = False) -> None:
    """Write make(i)'s image bytes for each of `layers` (each at an ALIGN boundary, the file
    padded to whole blocks so every O_DIRECT read is full), then the index: `identity`, each
    layer's span and layout, with `checksums` its sampled CRC (disk.fingerprint), and the data
    file's size and mtime as written. The caller holds the file's lock (_locked). Both files
    are written to temporary names in their folder, fsynced and renamed into place, the index
    last: a reader, or a crash, never meets a half-written file or an index describing one.
    Every filesystem failure is an ImageFileError naming the path. `keep_cached`: leave the
    written pages in the page cache (a resident image is mapped right after)."""
    tmp: Path | None = None
    try:
        data.parent.mkdir(parents=True, exist_ok=True)
        old = data.stat().st_size if data.exists() else 0
        check_space(data.parent, sum(_round_up(image_bytes[i]) for i in layers), old)
        index.unlink(missing_ok=True)  # no index may describe the data file being replaced
        for stale in data.parent.glob(f"{data.name}.*.tmp"):  # a killed writer's (we hold
            stale.unlink(missing_ok=True)                      # the lock: none is running)
        fd, name = tempfile.mkstemp(prefix=data.name + ".", suffix=".tmp", dir=data.parent)
        tmp = Path(name)
        entries = _write_data(fd, layers, image_bytes, make, what, progress, checksums,
                              keep_cached)
        _replace_durably(tmp, data)
        tmp = None
        st = data.stat()
        doc = {"model": identity, "layers": entries}
        if checksums:
            doc["file"] = [st.st_size, st.st_mtime_ns]
        fd, name = tempfile.mkstemp(prefix=index.name + ".", suffix=".tmp", dir=index.parent)
        tmp = Path(name)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(json.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        _replace_durably(tmp, index)
        tmp = None
    except OSError as e:
        raise _fs_error(tmp if tmp is not None else data, e) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _write_data(fd: int, layers: list[int], image_bytes: list[int],
                make: Callable[[int], tuple[torch.Tensor, dict]], what: str, progress: bool,
                checksums: bool, keep_cached: bool = False) -> dict[str, dict]:
    """The images of `layers` into the open file `fd` (closed here), fsynced; their index
    entries."""
    entries: dict[str, dict] = {}
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the images from other users
        offset = 0
        with Progress("[progress.description]{task.description}", BarColumn(),
                      DownloadColumn(), transient=True, disable=not progress) as bar:
            task = bar.add_task(what, total=sum(image_bytes[i] for i in layers))
            for i in layers:
                host, layout = make(i)
                view = memoryview(host.numpy())
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
                entries[str(i)] = {"start": offset, "end": offset + len(view),
                                   "layout": layout}
                if checksums:
                    entries[str(i)]["crc"] = fingerprint(view, 0, len(view))
                offset = _round_up(offset + len(view))
                bar.advance(task, len(view))
        os.ftruncate(fd, offset)  # whole aligned blocks, so every O_DIRECT read is full
        os.fsync(fd)
        # The writes went through the page cache; drop them so the streamed tier measures the
        # disk (O_DIRECT reads bypass the cache anyway; this frees the RAM).
        if hasattr(os, "posix_fadvise") and not keep_cached:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return entries
