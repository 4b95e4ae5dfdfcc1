"""The cache keeps to itself: pulls whose URL or Hub address decodes to a path out of it, a
symlinked folder inside it, `rm` through a symlink; a download that ends early without a
Content-Length; an offline Hub; what `rm` and a failed pull leave. Against the local server
(fakehub.py), through `python -m slipstream` where the CLI's one-line error is the point."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import quote

import pytest
from fakehub import FILE, REPO, gets, one_line_error, slipstream

from slipstream.hub import http, store
from slipstream.hub.paths import UnsafePath
from slipstream.hub.refs import UrlRef

PRECIOUS = "a file outside the cache\n"
FAKE_MODEL = b"GGUF" + b"\0" * 60  # all a file needed to replace another before


def tree(root: Path) -> list[str]:
    """Everything under root (files, folders, links), as relative paths."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text(PRECIOUS)
    return v


# --- traversal ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["absolute", "climb", "dot-segments"])
def test_a_url_cannot_write_outside_the_cache(env, hub, victim, tmp_path, how, cli_in_process):
    """A last segment that decodes to an absolute path replaced the victim before; '..%2F'
    climbed out of url/HOST/. Now the pull is refused before any request, in one line."""
    name = {"absolute": quote(str(victim), safe=""),
            "climb": quote("../../../../victim.txt", safe=""),
            "dot-segments": "%2e%2e/%2e%2e/%2e%2e/%2e%2e/victim.txt"}[how]
    hub.plain[name] = FAKE_MODEL
    args = ("pull", f"{hub.url}/files/{name}")
    # one through the real process, the others in this one (1 s less each)
    r = slipstream(env, *args) if how == "absolute" else cli_in_process(*args)
    one_line_error(r, "path component", "cannot name a file inside the cache")
    assert victim.read_text() == PRECIOUS
    assert hub.log == []  # refused before it asked the server
    assert tree(tmp_path / "cache") == []


@pytest.mark.parametrize("encoded", ["%2e%2e%2F%2e%2e%2F%2e%2e%2F%2e%2e%2Fvictim.gguf",
                                     "..%2F..%2F..%2F..%2Fvictim.gguf",
                                     "%2Ftmp%2Fvictim.gguf"])
def test_a_hub_address_cannot_write_outside_the_cache(env, hub, tmp_path, encoded,
                                                     cli_in_process):
    """A Hub web address is percent-decoded into the file name (this failed with a
    traceback); now it is one line, and neither huggingface_hub nor the server is asked."""
    hub.repos[REPO]["victim.gguf"] = FAKE_MODEL
    args = ("pull", f"https://huggingface.co/{REPO}/resolve/main/{encoded}")
    r = slipstream(env, *args) if encoded.startswith("%2e") else cli_in_process(*args)
    one_line_error(r, f"Hub file {REPO}/", "path component")
    assert hub.log == [] and tree(tmp_path / "cache") == []
    assert not (tmp_path / "victim.gguf").exists()


def test_a_symlinked_folder_in_the_cache_is_not_written_through(hub, tmp_path,
                                                                  cli_in_process):
    outside = tmp_path / "outside"
    outside.mkdir()
    host = hub.url.split("//")[1].replace(":", "_")
    (tmp_path / "cache" / "url").mkdir(parents=True)
    (tmp_path / "cache" / "url" / host).symlink_to(outside)
    one_line_error(cli_in_process("pull", f"{hub.url}/files/{FILE}"), "outside the cache")
    assert list(outside.iterdir()) == [] and hub.log == []


def test_a_pull_never_replaces_a_file_slipstream_did_not_write(hub, cli_in_process):
    url = f"{hub.url}/files/{FILE}"
    dest = store.url_path(UrlRef(url))
    dest.parent.mkdir(parents=True)
    dest.write_text("the user's own notes\n")  # not a GGUF: a pull would download
    one_line_error(cli_in_process("pull", url), "slipstream did not download it")
    assert dest.read_text() == "the user's own notes\n" and gets(hub) == []
    assert sorted(p.name for p in dest.parent.iterdir()) == [FILE]  # no lock, no partial


def test_only_the_file_slipstream_moved_there_counts_as_its_own(hub, cli_in_process):
    r = cli_in_process("pull", f"{hub.url}/files/{FILE}")
    assert r.returncode == 0, r.stderr
    dest = Path(r.stdout.strip())
    meta = json.loads(dest.with_name(dest.name + ".source.json").read_text())
    assert http._ours(dest, meta)
    os.utime(dest, ns=(0, 0))  # a file that changed since (or another put in its place)
    assert not http._ours(dest, meta)
    assert sorted(p.name for p in dest.parent.iterdir()) == [FILE, FILE + ".source.json"]


# --- rm and symlinks ---------------------------------------------------------------------

@pytest.mark.parametrize("link, name", [("hf/alice/linked", "alice/linked/elsewhere.gguf"),
                                        ("url/evil", "elsewhere.gguf")])
def test_rm_never_follows_a_symlinked_folder_out_of_the_cache(tmp_path, gguf_bytes, link, name,
                                                              cli_in_process):
    """A repository folder of the cache that is a symlink to another folder: `rm NAME`
    deleted the file behind it. Nothing behind it is listed, found or removed now."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "elsewhere.gguf").write_bytes(gguf_bytes)
    cache = tmp_path / "cache"
    (cache / link).parent.mkdir(parents=True)
    (cache / link).symlink_to(outside)
    r = cli_in_process("list")
    assert r.returncode == 0 and "elsewhere" not in r.stdout, r.stdout
    one_line_error(cli_in_process("rm", name), "no cached model named")
    assert (outside / "elsewhere.gguf").read_bytes() == gguf_bytes
    # and store.remove itself refuses such a path, whoever hands it one
    with pytest.raises(UnsafePath, match="outside the cache"):
        store.remove(store.CachedModel(name, cache / link / "elsewhere.gguf", 0, ""))
    assert (outside / "elsewhere.gguf").read_bytes() == gguf_bytes


def test_rm_of_a_symlinked_model_removes_the_link_not_its_target(tmp_path, gguf_bytes,
                                                                 cli_in_process):
    target = tmp_path / "mine.gguf"
    target.write_bytes(gguf_bytes)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "linked.gguf").symlink_to(target)
    r = cli_in_process("rm", "linked")
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "cache") == [] and target.read_bytes() == gguf_bytes


def test_rm_removes_the_layer_images_written_for_the_model(env, gguf_bytes, monkeypatch,
                                                           capsys):
    """memory/image_file.py writes MODEL.slipstream[-cpu].KEY.img/.json (KEY: the plan's
    streamed layers) beside the model, or in cache/images/ where the model's folder is not
    writable; rm deletes those of every plan, by the names that module itself gives, and the
    model's checked-tensors record and tokenizer cache entry."""
    from slipstream import cli
    from slipstream.memory import image_file

    monkeypatch.setenv("SLIPSTREAM_CACHE", env["SLIPSTREAM_CACHE"])
    path = store.url_path(UrlRef(f"https://example.com/m/{FILE}"))
    path.parent.mkdir(parents=True)
    path.write_bytes(gguf_bytes)
    written = []
    for kind in ("slipstream", "slipstream-cpu"):
        for layers in ([3, 4, 5], [1, 7]):  # two plans
            written += image_file.image_paths(path, kind, layers=layers)
            with monkeypatch.context() as mp:  # its folder read-only: cache/images/ instead
                mp.setattr(os, "access", lambda p, mode: False)
                written += image_file.image_paths(path, kind, layers=layers)
    written += [w.with_name(w.name + ".tmp") for w in written[:2]]  # a write cut short
    assert len(set(written)) == 18 and any("images" in w.parts for w in written)
    # the record of its checked tensors (weights.checked), and its tokenizer's cache entry
    from slipstream.modelfile.tokenizer_cache import cache_key
    from slipstream.weights import checked

    written.append(store.written_path(path, checked.KIND))
    written.append(store.cache_dir() / "tokenizers" / f"{cache_key(path)}.json")
    other = store.cache_dir() / "tokenizers" / ("0" * 32 + ".json")  # another model's: kept
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text("{}")
    for w in written:
        w.parent.mkdir(parents=True, exist_ok=True)
        w.write_bytes(b"image")
    assert cli.main(["rm", FILE]) == 0, capsys.readouterr().err
    assert [w for w in written if w.exists()] == []
    assert not path.exists() and not path.parent.exists() and other.exists()


# --- downloads that end early ------------------------------------------------------------

def test_a_short_download_without_a_length_is_no_model(hub, gguf_bytes, tmp_path,
                                                       cli_in_process):
    """No Content-Length, and the connection closes a third of the way in: the fragment is
    no model (not listed, not renamed), the pull fails in one line after its retries, and
    the next pull, served whole, completes it."""
    url = f"{hub.url}/files/big.gguf"
    hub.plain["big.gguf"] = gguf_bytes
    hub.no_length, hub.cut_at = {"big.gguf"}, len(gguf_bytes) // 3
    one_line_error(cli_in_process("pull", url), "no size from the server",
                   "is no whole GGUF", "run the same command again")
    assert len(gets(hub)) == 1 + http.RETRIES
    cache = tmp_path / "cache"
    assert not list(cache.rglob("*.gguf"))
    partial = next(cache.rglob("big.gguf.partial"))
    assert partial.stat().st_size == hub.cut_at
    r = cli_in_process("list")
    assert "no models" in r.stderr and "1 unfinished download(s)" in r.stderr
    hub.cut_at = None
    r = cli_in_process("pull", url)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes and not partial.exists()


def test_a_whole_download_without_a_length_is_the_model(hub, gguf_bytes, cli_in_process):
    hub.plain["big.gguf"], hub.no_length = gguf_bytes, {"big.gguf"}
    r = cli_in_process("pull", f"{hub.url}/files/big.gguf")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes and len(gets(hub)) == 1


# --- an offline Hub ----------------------------------------------------------------------

def _closed_port() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _silent_port(stack: ExitStack) -> str:
    """A port that takes connections and never answers (a Hub behind a dropping firewall
    looks so): the kernel completes the handshake from the backlog, nothing accepts."""
    s = stack.enter_context(socket.socket())
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("where", [
    "closed port",
    pytest.param("silent port", marks=pytest.mark.slow),  # waits out the 2 s try
    pytest.param("unroutable", marks=pytest.mark.slow),  # 2 s where packets are dropped
])
def test_an_offline_hub_says_so_within_3_s(env, monkeypatch, capsys, tmp_path, where):
    """One short try, then one line (huggingface_hub alone retried for 24 s in silence).
    Timed in-process: the interpreter's own start is no part of the wait."""
    from slipstream import cli

    stack = ExitStack()
    dead = {"closed port": _closed_port, "silent port": lambda: _silent_port(stack),
            "unroutable": lambda: "http://10.255.255.1"}[where]()
    for k, v in (env | {"HF_ENDPOINT": dead}).items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    assert cli.main(["pull", f"{REPO}/{FILE}"]) == 1
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert took < 3.0, f"{took:.1f} s"
    assert err.count("\n") == 1 and f"cannot reach {dead}" in err.replace("\n", ""), err
    assert tree(tmp_path / "cache") == []
    stack.close()


def test_an_offline_hub_still_gives_what_the_cache_has(env, monkeypatch, gguf_bytes, tmp_path):
    from slipstream.hub.pull import pull

    for k, v in (env | {"HF_ENDPOINT": _closed_port()}).items():
        monkeypatch.setenv(k, v)
    cached = tmp_path / "cache" / "hf" / REPO / FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(gguf_bytes)
    assert pull(f"{REPO}/{FILE}", quiet=True) == cached


# --- what a failed pull leaves -----------------------------------------------------------

def test_a_failed_url_pull_leaves_only_the_resumable_partial(hub, gguf_bytes, tmp_path,
                                                             cli_in_process):
    cache = tmp_path / "cache"
    one_line_error(cli_in_process("pull", f"{hub.url}/files/missing.gguf"), "HTTP 404")
    one_line_error(cli_in_process("pull", f"{_closed_port()}/files/{FILE}"), "cannot reach")
    hub.drops, hub.drop_at = 100, 0  # the headers, then not one byte: nothing to resume
    one_line_error(cli_in_process("pull", f"{hub.url}/files/{FILE}"), "resume")
    assert tree(cache) == []  # no lock file, no empty partial, no empty folder
    hub.drops, hub.drop_at = 100, len(gguf_bytes) // 2
    one_line_error(cli_in_process("pull", f"{hub.url}/files/{FILE}"), "resume")
    host = hub.url.split("//")[1].replace(":", "_")
    left = [p for p in tree(cache) if not (cache / p).is_dir()]
    assert left == [f"url/{host}/files/{FILE}.partial", f"url/{host}/files/{FILE}.source.json"]


@pytest.mark.parametrize("name", ["missing.gguf", "fake.gguf"])
def test_a_failed_hub_pull_leaves_nothing(hub, tmp_path, name, cli_in_process):
    """huggingface_hub's lock and metadata folders go too: nothing there resumes anything."""
    hub.repos[REPO]["fake.gguf"] = b"# not a model\n"
    r = cli_in_process("pull", f"{REPO}/{name}")
    one_line_error(r)
    assert tree(tmp_path / "cache") == []


def test_the_download_lock_serialises_pulls_and_is_deleted_by_its_holder(tmp_path):
    """A second pull of one URL waits for the first; the lock file goes with the last one
    (a failed pull left one per URL in locks/ before), and a waiter that wakes on the file
    its holder deleted locks the new one instead of sharing a dead lock."""
    lock = tmp_path / "cache" / "url" / "h" / "m.gguf.lock"
    order: list[str] = []
    a_in, b_started = threading.Event(), threading.Event()

    def a():
        with http._locked(lock):
            order.append("a in")
            a_in.set()
            assert b_started.wait(10)
            time.sleep(0.2)  # b is blocked on a's lock meanwhile
            order.append("a out")

    def b():
        assert a_in.wait(10)
        b_started.set()
        with http._locked(lock):
            order.append("b in")
            assert lock.exists()  # its own, made after a deleted a's

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert order == ["a in", "a out", "b in"]
    assert not lock.exists()


def test_an_unusable_cache_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """A cache path that cannot be a folder (it lies under a file) fails the command in one
    line naming it, as every filesystem failure the commands meet."""
    from slipstream import cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(blocker / "cache"))
    assert cli.main(["pull"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a-file" in err[0] and err[0].startswith("error:"), err
