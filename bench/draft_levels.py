"""The cost of one draft tree level by its width, on the synthetic 8B Q4_K held resident:
what speculation's tree growth pays per level (issue: "make a level cost a few ms").

    python bench/draft_levels.py OUT_DIR [--workdir /tmp/slipstream-models]

Each level is `Engine.forward` over n sibling nodes below a 256-token prefix with a tree step,
through the engine's CUDA graphs and eagerly, logits read back as growth reads them
(spec_bench.level_costs). Widths from 5 go through kernels.qgemm. Writes
OUT_DIR/draft-levels.json (the GPU results shape: device, date, commit, tree).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import slipstream  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402
from spec_bench import level_costs  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--workdir", default="/tmp/slipstream-models")
    ap.add_argument("--name", default="draft-levels.json", help="the JSON file's name")
    a = ap.parse_args()
    path = Path(a.workdir) / "8b-Q4_K.gguf"
    model = slipstream.load(str(path), device="cuda", ctx=1024)
    rows = level_costs(model.engine, WIDTHS)
    rev = source_revision()
    doc = {"device": torch.cuda.get_device_name(), "commit": rev["commit"], "tree": rev["tree"],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "model": path.name, "precision": "fast (the CUDA default)",
           "qgemm_kernel": os.environ.get("SLIPSTREAM_QGEMM", "default"), "levels": rows}
    Path(a.out_dir, a.name).write_text(json.dumps(doc, indent=1))
    print(f"{'width':>5s} {'graph ms':>9s} {'eager ms':>9s}")
    for r in rows:
        print(f"{r['nodes']:5d} {r['level_graph_s'] * 1e3:9.2f} {r['level_eager_s'] * 1e3:9.2f}"
              + ("  (graph fell back to eager)" if r["graph_fell_back_to_eager"] else ""))


if __name__ == "__main__":
    main()
