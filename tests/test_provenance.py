"""Benchmark results name the source that ran: the commit, and the tree as it is on disk."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from slipstream.provenance import source_revision

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_tree_is_the_files_on_disk_not_the_last_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = source_revision(tmp_path)
    assert first == {"commit": _git(tmp_path, "rev-parse", "HEAD"),
                     "tree": _git(tmp_path, "rev-parse", "HEAD^{tree}")}
    # files newer than .git (as on the GPU machine): the tree follows the files
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 3\n")
    changed = source_revision(tmp_path)
    assert changed["commit"] == first["commit"] and changed["tree"] != first["tree"]
    assert _git(tmp_path, "diff", "--cached", "--name-only") == ""  # real index untouched
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    assert changed["tree"] == _git(tmp_path, "rev-parse", "HEAD^{tree}")


def test_no_checkout_gives_none(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_COMMIT", raising=False)
    assert source_revision(tmp_path) == {"commit": None, "tree": None}
