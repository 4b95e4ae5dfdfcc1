"""A CPU model's tensor data read into private memory in one pass (private_file_bytes), that
read started ahead, in a thread, for a load that will ask for it (read_ahead), and the map's
pages dropped from the process once it holds them (release_mapped_pages): see
weights.loader's module doc for why a CPU model's weights are private."""

from __future__ import annotations

import mmap
import threading

import torch

from ..errors import GGUFError
from ..modelfile.gguf_file import GGUFFile


def private_file_bytes(gf: GGUFFile) -> tuple[torch.Tensor, int]:
    """(bytes, base): the file's tensor data, [base, end of the last tensor), read into
    private memory in one pass. A private CPU model holds its weights' GGUF bytes anyway
    (decode packs from them, prefill dequantizes them at first use); one read of 98 MB took
    0.1 s on a 2-core machine, where copying the same bytes tensor by tensor out of the
    memory map faulted its pages in one by one and took 0.3-2.1 s under load. Where
    read_ahead(gf) started the read, its result (or its error)."""
    ahead = gf.__dict__.pop("_read_ahead", None)
    if ahead is not None:
        return ahead.result()
    infos = list(gf.tensors.values())
    base = min((t.offset for t in infos), default=0)
    end = max((t.offset + t.n_bytes for t in infos), default=base)
    buf = torch.empty(end - base, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()), 0
    with open(gf.path, "rb", buffering=0) as f:
        f.seek(base)
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise GGUFError(f"{gf.path.name}: the file ends at byte {base + done}, inside "
                                f"its tensor data (ending at {end}): truncated while loading")
            done += got
    return buf, base


class _ReadAhead:
    """private_file_bytes(gf) in a thread: the read releases the GIL, so it goes on beside
    what the load does before it needs the bytes (the tokenizer: 0.1 s from its cache entry,
    0.2 s built from the file, against a read of 0.05 s from the page cache and 0.07-0.14 s
    from disk for the default model on a 2-core machine)."""

    def __init__(self, gf: GGUFFile):
        self._out: tuple[torch.Tensor, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(gf,), daemon=True,
                                        name="slipstream-read-ahead")
        self._thread.start()

    def _run(self, gf: GGUFFile) -> None:
        try:
            self._out = private_file_bytes(gf)
        except BaseException as e:  # noqa: BLE001 (raised where the bytes are asked for)
            self._error = e

    def result(self) -> tuple[torch.Tensor, int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


def read_ahead(gf: GGUFFile) -> None:
    """Start reading the file's tensor data into private memory now, for a load that will
    ask for it (private_file_bytes: a whole CPU model with private weights). A load that does
    not ask drops it (load_weights), so a caller starts it only where the bytes are sure to
    fit: api.load, for a CPU model far smaller than the free RAM."""
    if "_read_ahead" not in gf.__dict__:
        gf.__dict__["_read_ahead"] = _ReadAhead(gf)


def release_mapped_pages(gf: GGUFFile) -> None:
    """Unmap the file pages the load touched from this process (MADV_DONTNEED on a read-only
    shared map drops them from our RSS; they stay in the page cache, clean). A private model
    reads nothing through the map any more, so they would only inflate RSS; a streamed layer
    or a later map reader faults them in again, unchanged."""
    data = getattr(getattr(gf, "reader", None), "data", None)
    mm = getattr(data, "_mmap", None)  # numpy.memmap keeps its mmap.mmap here
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        mm.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):  # a closed map, or an OS without it: only RSS is at stake
        pass
