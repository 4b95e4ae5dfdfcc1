"""What every benchmark tool shares: where the source is, the record of the machine and the source
that ran (device, host CPU, cores, L3, date, commit), result files named by date, case and
device, a printed table, the synthetic anchor-shaped models, and llama.cpp's llama-bench run on
the same file in the same run.

A result file is `RESULTS/YYYY-MM-DD-<case>-<device>.json`: {"case", "device", "host", "date",
"commit", "tree", "torch", ...the tool's figures}. RESULTS is benchmarks/results/ unless a tool's
--results says otherwise (the device scripts pass $OUT).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
if str(SRC) not in sys.path:  # the tools run from a checkout, not an installed package
    sys.path.insert(0, str(SRC))

RESULTS = ROOT / "benchmarks" / "results"
# the synthetic files: BENCH_MODELS (the device scripts put it on /dev/shm where it fits)
MODELS = Path(os.environ.get("BENCH_MODELS") or "/tmp/slipstream-models")


def host_info() -> dict[str, Any]:
    """The CPU the figures ran beside: model name, cores this process may use, last-level cache."""
    from slipstream.provenance import cpu_name

    l3 = None
    try:
        from slipstream.hybrid.plan import last_level_cache_bytes

        l3 = last_level_cache_bytes() >> 20
    except Exception:  # an older or newer tree without it: the record goes without
        pass
    return {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "l3_mib": l3}


def device_name(device: str = "cuda") -> str:
    """The accelerator's name ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return "cpu"


def device_slug(name: str) -> str:
    """A file-name form of a device name: "NVIDIA H100 80GB HBM3" -> "h100", "cpu" -> "cpu"."""
    m = re.search(r"\b([A-Z]+\d+[A-Za-z]?)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


def provenance(device: str = "cuda") -> dict[str, Any]:
    """device, host, date, commit, tree and torch: the fields every result file starts with."""
    import torch

    from slipstream.provenance import source_revision

    return {"device": device_name(device), "host": host_info(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
            "torch": torch.__version__}


def write_result(case: str, doc: dict[str, Any], results: Path | str | None = None) -> Path:
    """doc (provenance() first, then the figures) into RESULTS/YYYY-MM-DD-<case>-<device>.json."""
    out = Path(results or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    day = str(doc.get("date", ""))[:10] or time.strftime("%Y-%m-%d", time.gmtime())
    path = out / f"{day}-{case}-{device_slug(str(doc.get('device', 'cpu')))}.json"
    path.write_text(json.dumps({"case": case, **doc}, indent=1) + "\n")
    return path


def table(rows: Iterable[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a fixed-width table: columns are (key, heading, format), e.g. ("tok_s", "tok/s",
    ".2f"); a missing or None value prints as "-"."""
    rows = list(rows)
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None else format(v, fmt) if fmt and not isinstance(v, str)
                        else str(v))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths))) for line in cells)


def synth_path(shape: str, quant: str = "Q4_K", workdir: Path | None = None,
               arch: str = "llama", layers: int | None = None, skew: float = 0.0) -> Path:
    """Where synth_model keeps the file of these arguments."""
    stem = f"{shape}-{quant}" if arch == "llama" else f"{arch}-{shape}-{quant}"
    stem += (f"-{layers}l" if layers else "") + (f"-skew{skew:g}" if skew else "")
    return Path(workdir or MODELS) / f"{stem}.gguf"


def synth_model(shape: str, quant: str = "Q4_K", workdir: Path | None = None,
                arch: str = "llama", layers: int | None = None, skew: float = 0.0) -> Path:
    """The anchor-shaped synthetic model (all 2-D weights `quant`, the head Q6_K), written once:
    the 8B is hidden 4096, ffn 14336, 32 layers; the 70B hidden 8192, ffn 28672, 80 layers;
    27b and 32b are Gemma-3-27B's and Qwen3-32B's shapes (slipstream.synth.SHAPES), of the
    family `arch`; `layers` fewer layers than the shape's, `skew` a mixture of experts'
    routing skewed (synth --expert-skew)."""
    from slipstream.synth import write_synth

    path = synth_path(shape, quant, workdir, arch, layers, skew)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_suffix(".part")
        write_synth(tmp, shape, quant, arch=arch, n_layers=layers, expert_skew=skew)
        tmp.rename(path)
        # flush the new file now: writeback of GiBs of dirty pages during timed runs slowed
        # eager prefill by a third on an H200's host (graph-replayed decode, not)
        os.sync()
    return path


def llama_bench(build: str | Path, model: Path, args: list[str], timeout: float = 300) -> dict:
    """llama.cpp's llama-bench (`build` is its build folder or the binary) on `model`, now:
    {"command", "pp512_tok_s", "tg_tok_s", "tg_test", "stds", "raw"}; an "error" key where it
    could not run. Its figures are the comparison only when measured in the same run."""
    exe = Path(build)
    if exe.is_dir():
        exe = next((p for p in (exe / "bin" / "llama-bench", exe / "llama-bench") if p.exists()),
                   exe / "bin" / "llama-bench")
    cmd = [str(exe), "-m", str(model), "-o", "json", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"command": " ".join(cmd), "error": f"{type(e).__name__}: {e}"}
    try:
        runs = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"command": " ".join(cmd), "error": (proc.stderr or proc.stdout)[-400:]}
    out: dict[str, Any] = {"command": " ".join(cmd), "runs": []}
    for r in runs:
        n_p, n_g = r.get("n_prompt", 0), r.get("n_gen", 0)
        test = f"pp{n_p}" if n_p and not n_g else f"tg{n_g}"
        row = {"test": test, "tok_s": r.get("avg_ts"), "tok_s_std": r.get("stddev_ts"),
               "threads": r.get("n_threads"), "ngl": r.get("n_gpu_layers")}
        out["runs"].append(row)
        if test == "pp512":
            out["pp512_tok_s"] = max(out.get("pp512_tok_s") or 0, row["tok_s"] or 0)
        elif test.startswith("tg"):
            if (row["tok_s"] or 0) > (out.get("tg_tok_s") or 0):
                out.update(tg_tok_s=row["tok_s"], tg_test=test, tg_threads=row["threads"])
    if runs:
        out["build"] = {k: runs[0].get(k) for k in ("build_commit", "cpu_info", "gpu_info")}
    return out
