"""The cache's name-to-path functions, fuzzed: whatever a URL or a Hub id holds, the path it
gets lies inside the cache, or the name is refused with UnsafePath naming it."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slipstream.errors import BadArgument
from slipstream.hub import store
from slipstream.hub.paths import UnsafePath, check_inside, component, inside
from slipstream.hub.refs import HubRef, UrlRef, parse_ref

# segments made mostly of the characters a traversal is built from, plus any text at all
_TRICKY = st.text(alphabet=st.sampled_from(list("./\\%2eEfF\0a_-:~ ")), max_size=12)
SEGMENT = st.one_of(_TRICKY, st.text(max_size=20), st.sampled_from(
    ["..", ".", "", "%2e%2e", "%2E%2e", "..%2F", "%2F", "%2fetc%2fpasswd", "%00", "..%5C"]))
# 120 examples keep each test under a second on a shared 2-core machine; the @example cases
# are the traversals seen in the wild. No example database: nothing written into the tree.
FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(root))
    return root


def _assert_inside(cache: Path, path: Path) -> None:
    assert path.is_absolute() and os.path.normpath(path) == str(path)
    assert ".." not in path.parts
    assert cache in path.parents
    assert cache.resolve() in path.resolve().parents


@FUZZ
@given(host=st.sampled_from(["example.com", "h:8080", "u:p@h", "..", "[::1]:9"]),
       segments=st.lists(SEGMENT, max_size=5), raw=st.booleans())
@example(host="h", segments=["%2Fetc%2Fpasswd"], raw=True)
@example(host="h", segments=["a", "..%2F..%2F..%2Fx.gguf"], raw=True)
@example(host="h", segments=["%2e%2e", "x.gguf"], raw=True)
def test_a_url_lands_inside_the_cache_or_is_refused(cache, host, segments, raw):
    path = "/".join(s if raw else quote(s, safe="") for s in segments)
    ref = UrlRef(f"http://{host}/{path}")
    try:
        out = store.url_path(ref)
    except UnsafePath as e:
        assert ref.url in str(e)  # the error names the URL
        return
    _assert_inside(cache / "url", out)
    # the file keeps the name the URL gives it: nothing is dropped or rewritten silently
    assert out.parts[-len(ref.parts):] == ref.parts if ref.parts else out.name == "model.gguf"


@FUZZ
@given(filename=st.lists(SEGMENT, min_size=1, max_size=4).map("/".join))
@example(filename="../../x.gguf")
@example(filename="/etc/x.gguf")
@example(filename="a//b.gguf")
def test_a_hub_file_lands_inside_the_cache_or_is_refused(cache, filename):
    ref = HubRef("alice/repo", filename)
    try:
        out = store.hub_file(ref)
    except UnsafePath as e:
        assert ref.name in str(e)
        return
    _assert_inside(cache / "hf" / "alice" / "repo", out)
    assert out == cache / "hf" / "alice" / "repo" / filename


@FUZZ
@given(filename=st.lists(SEGMENT, min_size=1, max_size=4).map("/".join))
def test_a_hub_address_parses_to_a_safe_path_or_is_refused(cache, filename):
    """A Hub web address is percent-decoded by parse_ref: what decodes to a traversal must
    be refused by the path function, not reach huggingface_hub."""
    ref = parse_ref(f"https://huggingface.co/alice/repo/resolve/main/{filename}.gguf")
    if not isinstance(ref, HubRef):
        return
    try:
        _assert_inside(cache, store.hub_file(ref))
    except UnsafePath:
        pass


@given(parts=st.lists(st.text(alphabet=st.characters(blacklist_characters="/\\\0"),
                              min_size=1, max_size=40), min_size=1, max_size=4))
@FUZZ
def test_plain_names_are_kept_as_they_are(cache, parts):
    def unsafe(p: str) -> bool:
        try:
            return p in (".", "..") or len(os.fsencode(p)) > 255
        except UnicodeEncodeError:
            return True

    if any(unsafe(p) for p in parts):
        with pytest.raises(UnsafePath):
            inside(cache, parts, "test")
        return
    assert inside(cache, parts, "test") == cache.joinpath(*parts)


@pytest.mark.parametrize("part", ["", ".", "..", "a/b", "/etc", "a\\b", "a\0b", "x" * 256,
                                  "\ud800"])
def test_component_refuses_and_names_it(part):
    with pytest.raises(UnsafePath, match="path component") as e:
        component(part, "URL http://h/x")
    assert repr(part) in str(e.value) and "URL http://h/x" in str(e.value)
    assert isinstance(e.value, BadArgument)  # the CLI's one-line error


def test_a_symlink_out_of_the_cache_is_refused(cache, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache / "url").mkdir()
    (cache / "url" / "h").symlink_to(outside)
    with pytest.raises(UnsafePath, match="outside the cache"):
        store.url_path(UrlRef("http://h/m.gguf"))
    (cache / "link.gguf").symlink_to(outside / "m.gguf")
    with pytest.raises(UnsafePath):
        check_inside(cache, cache / "link.gguf", "test")
    # a symlink as the last component is allowed where the caller removes only the link
    assert check_inside(cache, cache / "link.gguf", "test", follow_last=False)
    # a symlink that stays inside the cache is fine
    (cache / "url" / "g").symlink_to(cache / "url" / "elsewhere")
    assert store.url_path(UrlRef("http://g/m.gguf")) == cache / "url" / "g" / "m.gguf"


@pytest.mark.parametrize("name", ["m.gguf.partial", "m.gguf.source.json", "m.gguf.lock",
                                  "m.gguf.slipstream-cpu.img", "m.gguf.slipstream.json"])
def test_a_url_named_like_a_cache_file_is_refused(cache, name):
    with pytest.raises(UnsafePath, match="ends like a file the cache keeps"):
        store.url_path(UrlRef(f"http://h/{name}"))
