"""The registry of SLIPSTREAM_* variables (slipstream.envs): every name the source reads is
registered, docs/env-vars.md is the registry's own rendering, and values are checked when read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import slipstream
from slipstream import envs
from slipstream.errors import BadArgument

SRC = Path(slipstream.__file__).resolve().parent
DOCS = SRC.parents[1] / "docs" / "env-vars.md"
NAME = re.compile(r"SLIPSTREAM_[A-Z0-9_]+")


def names_in_source() -> set[str]:
    found: set[str] = set()
    for path in SRC.rglob("*"):
        if path.suffix in (".py", ".c", ".h") and path.name != "envs.py":
            found |= set(NAME.findall(path.read_text()))
    return found


def test_every_variable_the_source_names_is_registered():
    missing = names_in_source() - set(envs.REGISTRY)
    assert not missing, f"read but not in slipstream.envs: {sorted(missing)}"


def test_every_registered_variable_is_used():
    unused = set(envs.REGISTRY) - names_in_source()
    assert not unused, f"registered but read nowhere: {sorted(unused)}"


def test_the_docs_page_is_generated_from_the_registry():
    if not DOCS.exists():
        pytest.skip("no docs/ beside the package (an installed wheel)")
    assert DOCS.read_text() == envs.markdown(), (
        "docs/env-vars.md is stale: python -m slipstream.envs > docs/env-vars.md")


def test_values_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_IO_TIMEOUT_S", raising=False)
    assert envs.get("SLIPSTREAM_IO_TIMEOUT_S") == 60.0
    monkeypatch.setenv("SLIPSTREAM_IO_TIMEOUT_S", "2.5")
    assert envs.get("SLIPSTREAM_IO_TIMEOUT_S") == 2.5


@pytest.mark.parametrize("name,value", [("SLIPSTREAM_NATIVE", "yes"),
                                        ("SLIPSTREAM_IO_TIMEOUT_S", "-1"),
                                        ("SLIPSTREAM_GIL_SWITCH_S", "nan"),
                                        ("SLIPSTREAM_LAYER_GRAPHS", "2")])
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(BadArgument) as err:
        envs.get(name)
    assert name in str(err.value) and repr(value) in str(err.value)
    assert envs.REGISTRY[name].accepts in str(err.value)


def test_unset_without_a_default_is_none(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_CACHE", raising=False)
    assert envs.get("SLIPSTREAM_CACHE") is None
    assert not envs.is_set("SLIPSTREAM_CACHE")


def test_every_entry_is_documented():
    for var in envs.REGISTRY.values():
        assert var.kind in ("setting", "fallback", "opt-in", "debug"), var
        assert len(var.meaning) > 20, var
        assert var.default is None or var.parse(var.default) is not None or var.default == ""
