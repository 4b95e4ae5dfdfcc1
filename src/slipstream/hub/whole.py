"""Is a downloaded GGUF whole? For a server that sends no Content-Length, the only size there
is to check against is the file's own: its header says where every tensor's bytes lie, and a
transfer that broke off early ends before the last of them (a 10 MB fragment of a 1 GB model
would otherwise become the model, listed and never fetched again)."""

from __future__ import annotations

import mmap
from pathlib import Path

from ..errors import SlipstreamError
from ..modelfile.validate import scan_layout, tensor_nbytes


def gguf_data_end(path: Path) -> int:
    """The byte at which the last tensor of the GGUF at `path` ends (the end of its header
    for a file of no tensors). Raises a SlipstreamError (GGUFError, UnsupportedTensorType)
    when the header itself is cut short or is not a GGUF header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            return scan_layout(b"", 0, str(path)).data_offset  # raises: too short
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            lay = scan_layout(buf, size, str(path))
    end = lay.infos_end
    for t in lay.tensors:
        _, n = tensor_nbytes(t.type_id, t.dims, str(path), t.name)
        end = max(end, lay.data_offset + t.rel_offset + n)
    return end


def missing(path: Path) -> str | None:
    """None when every tensor of the GGUF at `path` lies inside the file; else why not, in a
    few words for an error message."""
    try:
        end = gguf_data_end(path)
    except SlipstreamError as e:
        return f"its header does not parse: {str(e).splitlines()[0]}"
    size = path.stat().st_size
    if end > size:
        return f"its tensors end at byte {end:,}, the file at {size:,}"
    return None
