"""Which source a measurement ran: recorded in every benchmark result.

`git rev-parse HEAD` alone can lie: the GPU machine receives a copy of the working tree whose
`.git` may be older than the files. So a result also records the hash of the tree as it is on
disk (what `git write-tree` gives after adding every file, computed on a scratch index so the
real one is untouched). It equals `git rev-parse COMMIT^{tree}` of the commit that ran, which
anyone can check against the history.
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from pathlib import Path

from . import envs

_ROOT = Path(__file__).resolve().parents[2]


def _git(root: Path, *args: str, env: dict | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             check=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def source_revision(root: Path = _ROOT) -> dict[str, str | None]:
    """{"commit": HEAD (or $SLIPSTREAM_COMMIT), "tree": the working tree's git tree hash};
    None where `root` is no git checkout."""
    commit = envs.get("SLIPSTREAM_COMMIT") or _git(root, "rev-parse", "HEAD")
    tree = None
    if commit is not None:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
            # .gitignore applies as usual, so built or carried files stay out, as in a commit
            _git(root, "add", "-A", ".", env=env)
            tree = _git(root, "write-tree", env=env)
    return {"commit": commit, "tree": tree}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for results measured on the host's CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
