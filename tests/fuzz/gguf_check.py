"""One fuzz case's check, as the fuzzer's worker runs it: what `load()` does before it allocates,
then (for a file that passes, or a sampled share of the others) a load, two generated tokens and
finite logits; and the worker's resident-memory readings, to tell a memory blow-up."""

from __future__ import annotations

import gc
import math
import os
import resource
import traceback
import warnings
from pathlib import Path
from typing import Any

def _mem_error(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or "can't allocate memory" in text or \
        "DefaultCPUAllocator" in text or "not enough memory" in text


def check_file(path: Path, full: bool, prompt: str = "Hello world, the",
               expect: list[str] | None = None) -> dict:
    """What load() does before allocating; then, for a file that passes (or `full`), a real
    load, 2 generated tokens and the logits. Returns {'outcome', 'stage', 'error', ...}, and
    'warnings': the slipstream warnings it issued.

    `expect`: the tensors a loud mutation damaged (gguf_mutations.loud_names). Such a file
    must be refused (a SlipstreamError) or loaded with a warning naming one of them; a load
    without that is the outcome 'silent', whatever the generation does after it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _check_file(path, full, prompt)
    from slipstream.errors import SlipstreamWarning

    said = [" ".join(str(w.message).split())[:300] for w in caught
            if issubclass(w.category, SlipstreamWarning)]
    if said:
        res["warnings"] = said[:4]
    loaded = res.get("stage") == "generate" or res.get("outcome") in ("ok", "nan")
    if expect and loaded and not any(n in w for w in said for n in expect):
        res.update(outcome="silent", clean_outcome=res.get("outcome"),
                   message=f"loaded with no warning naming {expect}: {said[:2]}")
    return res


def _check_file(path: Path, full: bool, prompt: str) -> dict:
    import torch

    import slipstream
    from slipstream import quant
    from slipstream.modelfile.chat_template import ChatTemplate
    from slipstream.modelfile.config import ModelConfig
    from slipstream.errors import NonFiniteLogits, SlipstreamError
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.modelfile.tokenizer import Tokenizer
    from slipstream.weights.loader import check_layer_shapes

    res: dict[str, Any] = {}

    def fail(stage: str, e: BaseException) -> dict:
        if isinstance(e, SlipstreamError):
            outcome = "clean"
        elif _mem_error(e):
            outcome = "memory"
        else:
            outcome = "uncaught"
        res.update(outcome=outcome, stage=stage, error=type(e).__name__,
                   message=" ".join(str(e).split())[:300])
        if isinstance(e, NonFiniteLogits):
            res["nonfinite"] = True
        if outcome != "clean":
            res["traceback"] = traceback.format_exc()[-2000:]
        return res

    try:
        gf = GGUFFile(path)
        try:
            cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
            Tokenizer.from_metadata(gf.metadata)
            ChatTemplate.from_metadata(gf.metadata)
            check_layer_shapes(gf, cfg)
            for info in gf.tensors.values():
                quant.get_format(info.ggml_type)
        finally:
            gf.close()
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        fail("validate", e)
        if not full:
            return res
    res["accepted"] = "outcome" not in res
    prevalidated = dict(res)
    try:
        model = slipstream.load(path, device="cpu", ctx=64)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        out = fail("load", e)
        if prevalidated.get("outcome") not in (None, "clean") and out["outcome"] == "clean":
            out.update({k: v for k, v in prevalidated.items()})
        return out
    if "outcome" in prevalidated and prevalidated["outcome"] != "clean":
        return prevalidated
    try:
        with model:
            ids = model.tokenize(prompt)
            events = list(model.generate(ids, max_tokens=2, seed=0))
            logits = model.logits(ids)
            finite = bool(torch.isfinite(logits).all())
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return fail("generate", e)
    if "outcome" in prevalidated:
        # refused by the checks above but loaded by load(): the two paths disagree
        return {"outcome": "uncaught", "stage": "load",
                "error": "LoadedDespiteValidation", "message": prevalidated.get("message", "")}
    res.update(outcome="ok" if finite else "nan", stage="generate", tokens=[e.id for e in events])
    return res


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, so that the next case's
    peak is its own and not one the harness set while building the case (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """VmHWM: the peak RSS since the last reset (ru_maxrss cannot be reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
