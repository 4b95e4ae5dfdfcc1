"""Re-encode a GGUF's weights in another format: `slipstream quantize`, and how speculative
decoding's drafts are made from a target (the same vocabulary and shapes, coarser weights).

Every tensor of the chosen source types goes through the reference dequantizer and then
slipstream's encoder (quant.encode); the others (norms, and by default the token embedding's
own type) are copied byte for byte, and the metadata is copied whole, so the tokenizer and chat
template are the source's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from ..errors import BadArgument
from ..modelfile.gguf_file import GGUFFile
from . import dequantize, get_format
from .encode import encodable_types, quantize

# Types that are weights (quantized or float matrices): 1-D F32 tensors are norms and stay
_NEVER = (GGMLQuantizationType.F32,)


def parse_type(name: str) -> GGMLQuantizationType:
    """'q4_0' / 'Q4_0' -> the type, or BadArgument naming the encodable ones."""
    names = {t.name: t for t in encodable_types()}
    t = names.get(name.upper())
    if t is None:
        raise BadArgument(f"cannot quantize to {name!r}: slipstream encodes "
                          f"{', '.join(sorted(names))}")
    return t


def requantize(src: str | os.PathLike[str], dst: str | os.PathLike[str],
               qtype: GGMLQuantizationType | str,
               only: Iterable[GGMLQuantizationType] | None = None,
               progress: Callable[[int, int], None] | None = None,
               fallback: GGMLQuantizationType | str | None = None) -> Path:
    """Write `dst`: `src` with its weight tensors re-encoded in `qtype`.

    only: re-encode just tensors of these types (default: every tensor that is not F32, i.e.
    every matrix; the norms stay F32). progress(done, total) is called per tensor.
    fallback: the type for matrices whose rows are not whole `qtype` blocks (K-quants need
    rows of 256: the default model's 576-wide matrices), as llama.cpp's quantizer does; None
    leaves them to the encoder, which refuses them."""
    qtype = parse_type(qtype) if isinstance(qtype, str) else GGMLQuantizationType(qtype)
    if qtype not in encodable_types():
        raise BadArgument(f"cannot quantize to {qtype.name}")
    if isinstance(fallback, str):
        fallback = parse_type(fallback)
    block = get_format(qtype).block_size
    only = set(only) if only is not None else None
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise BadArgument(f"quantize would overwrite its source {src}; name another file")
    gf = GGUFFile(src)
    tmp = dst.with_name(dst.name + ".part")
    try:
        w = GGUFWriter(tmp, gf.architecture)
        for key, fld in gf.reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = fld.types[0]
            w.add_key_value(key, gf.metadata[key], vtype,
                            fld.types[-1] if vtype == GGUFValueType.ARRAY else None)
        items = list(gf.tensors.items())
        for n, (name, info) in enumerate(items):
            raw = np.array(gf.tensor_bytes(name))
            pick = (info.ggml_type in only) if only is not None else (
                info.ggml_type not in _NEVER and len(info.shape) > 1)
            to = qtype if fallback is None or info.shape[-1] % block == 0 else fallback
            if pick and info.ggml_type != to:
                x = dequantize(torch.from_numpy(raw), info.ggml_type, info.shape).numpy()
                w.add_tensor(name, quantize(x, to), raw_dtype=to)
            elif info.ggml_type == GGMLQuantizationType.F32:
                w.add_tensor(name, raw.view(np.float32).reshape(info.shape))
            else:
                # rows of bytes, whatever the rank (a 3-D expert tensor keeps its experts)
                w.add_tensor(name, raw.reshape(*info.shape[:-1], -1), raw_dtype=info.ggml_type)
            if progress is not None:
                progress(n + 1, len(items))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dst)
    finally:
        gf.close()
        tmp.unlink(missing_ok=True)
    return dst
