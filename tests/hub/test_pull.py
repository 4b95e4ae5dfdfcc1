"""`slipstream pull`, `list`, `rm` and `-m` against a local server that answers the way the
Hugging Face Hub's resolve endpoint does (HF_ENDPOINT points huggingface_hub at it) and serves
plain URLs; through the real `python -m slipstream` process, so stdout, stderr and exit codes
are what a user sees."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakehub import COMMIT, FILE, REPO, gets, one_line_error, slipstream

from slipstream.hub.refs import HubRef, UrlRef, parse_ref


# --- references --------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("alice/tiny-GGUF/tiny-Q8_0.gguf", HubRef("alice/tiny-GGUF", "tiny-Q8_0.gguf")),
    ("alice/repo/sub/dir/m.GGUF", HubRef("alice/repo", "sub/dir/m.GGUF")),
    ("https://huggingface.co/alice/repo/resolve/main/m.gguf", HubRef("alice/repo", "m.gguf")),
    ("https://hf.co/alice/repo/blob/v1.0/m.gguf", HubRef("alice/repo", "m.gguf", "v1.0")),
    ("https://example.com/x/m.gguf", UrlRef("https://example.com/x/m.gguf")),
    ("./alice/repo/m.gguf", None),  # a path, written as one
    ("/models/alice/repo/m.gguf", None),
    ("repo/m.gguf", None),  # two parts: a relative path, not a Hub file
    ("alice/repo/m.bin", None),
    ("alice/repo/../m.gguf", None),
])
def test_parse_ref(text, expected):
    assert parse_ref(text) == expected


# --- the Hub -----------------------------------------------------------------------------

@pytest.mark.slow
def test_hub_pull_prints_only_the_path_then_list_info_rm(env, hub, gguf_bytes, tmp_path):
    ref = f"{REPO}/{FILE}"
    r = slipstream(env, "pull", ref)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert r.stdout == f"{path}\n"  # m=$(slipstream pull ...) works
    assert path == tmp_path / "cache" / "hf" / REPO / FILE and path.read_bytes() == gguf_bytes
    assert not list(path.parent.rglob("*.incomplete"))
    assert f"{len(gguf_bytes):,} bytes" in r.stderr

    # a second pull asks the Hub (HEAD: is the ETag still the same?) and downloads nothing
    n_gets = len(gets(hub))
    r = slipstream(env, "pull", ref)
    assert r.returncode == 0 and r.stdout == f"{path}\n", r.stderr
    assert len(gets(hub)) == n_gets

    r = slipstream(env, "list")
    assert r.returncode == 0, r.stderr
    flat = " ".join(r.stdout.split())
    assert ref in flat and f"hf {REPO}@{COMMIT[:12]}" in flat and "1.2 MiB" in flat

    # -m takes the Hub name, from the cache: offline, and with the server gone quiet
    hub.repos.clear()
    for m in (ref, FILE, FILE[:-5]):  # the list name, the file name, the file name's stem
        r = slipstream(env | {"HF_HUB_OFFLINE": "1"}, "info", "-m", m)
        assert r.returncode == 0, r.stderr
        assert "llama" in r.stdout and FILE in r.stdout

    for plan in (".slipstream-cpu.L0-1.img", ".slipstream-cpu.L0-1.lock", ".slipstream.H1.json"):
        path.with_name(path.name + plan).write_bytes(b"a plan's layer images")
    r = slipstream(env, "rm", ref)
    assert r.returncode == 0 and "removed" in r.stderr, r.stderr
    # the images went with it: the folder is pruned
    assert not path.exists() and not (tmp_path / "cache" / "hf" / REPO).exists()
    one_line_error(slipstream(env, "rm", ref), "no cached model named")
    r = slipstream(env, "list")
    assert r.returncode == 0 and r.stdout == "" and "no models" in r.stderr


def test_hub_file_in_a_subdirectory(env, hub, gguf_bytes, tmp_path):
    r = slipstream(env, "pull", f"{REPO}/sub/other.gguf")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes
    r = slipstream(env, "list")
    assert f"{REPO}/sub/other.gguf" in " ".join(r.stdout.split())


@pytest.mark.slow
def test_run_m_pulls_a_hub_file_before_loading(env, hub):
    """-m USER/REPO/FILE.gguf pulls first; then the run itself starts (a bad --temp after the
    pull would be refused before the pull: arguments are checked first)."""
    one_line_error(slipstream(env, "run", "-m", f"{REPO}/{FILE}", "--temp", "-1"),
                   "--temp -1")
    assert gets(hub) == []
    r = slipstream(env, "info", "-m", f"{REPO}/{FILE}")
    assert r.returncode == 0 and "llama" in r.stdout, r.stderr
    assert [p for p, _ in gets(hub)] == [f"/{REPO}/resolve/main/{FILE}"]


@pytest.mark.slow
def test_hub_resumes_a_dropped_connection(env, hub):
    """huggingface_hub resumes by itself, within one pull: the connection drops at 15 MiB, the
    next GET asks with a Range header for what follows the last whole chunk it wrote (it reads
    10 MiB chunks), and the file is whole. (A pull killed part-way: the next test.)"""
    big = b"GGUF" + os.urandom((24 << 20) - 4)  # only the magic is checked
    hub.repos[REPO]["big.gguf"] = big
    hub.drops, hub.drop_at = 1, 15 << 20
    r = slipstream(env, "pull", f"{REPO}/big.gguf")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == big
    assert gets(hub) == [(f"/{REPO}/resolve/main/big.gguf", None),
                         (f"/{REPO}/resolve/main/big.gguf", f"bytes={10 << 20}-")]


@pytest.mark.slow
def test_hub_resumes_a_pull_killed_mid_download(env, hub, tmp_path):
    """huggingface_hub 2.x never reuses the temporary file of a pull that was killed; slipstream
    resumes it: the next pull asks with a Range header for the bytes after it, the file ends
    whole, byte for byte, with huggingface_hub's metadata (a third pull downloads nothing),
    and no temporary file is left behind."""
    big = b"GGUF" + os.urandom((24 << 20) - 4)
    hub.repos[REPO]["big.gguf"] = big
    hub.stall_at = (12 << 20) + 5  # huggingface_hub writes whole 10 MiB chunks: 10 MiB of it
    left = _kill_mid_download(env, hub, f"{REPO}/big.gguf", tmp_path / "cache",
                              "*.incomplete")
    kept = left.read_bytes()
    assert len(kept) == 10 << 20 and kept == big[:len(kept)]
    hub.stall_at, hub.log[:] = 0, []
    r = slipstream(env, "pull", f"{REPO}/big.gguf")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(big).digest()
    assert gets(hub) == [(f"/{REPO}/resolve/main/big.gguf", f"bytes={len(kept)}-")]
    assert not list((tmp_path / "cache").rglob("*.incomplete"))
    hub.log[:] = []
    assert slipstream(env, "pull", f"{REPO}/big.gguf").stdout == r.stdout
    assert gets(hub) == []  # up to date: a HEAD, no download


@pytest.mark.slow
def test_hub_drops_what_a_killed_pull_left_of_a_changed_file(env, hub, tmp_path):
    """The file changed on the Hub since the pull was killed (another ETag): what it left is
    deleted and the new file downloaded whole."""
    old = b"GGUF" + os.urandom((12 << 20) - 4)
    hub.repos[REPO]["big.gguf"] = old
    hub.stall_at = (12 << 20) - 5
    _kill_mid_download(env, hub, f"{REPO}/big.gguf", tmp_path / "cache", "*.incomplete")
    new = b"GGUF" + os.urandom((12 << 20) - 4)
    hub.repos[REPO]["big.gguf"], hub.stall_at, hub.log[:] = new, 0, []
    r = slipstream(env, "pull", f"{REPO}/big.gguf")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == new
    assert gets(hub) == [(f"/{REPO}/resolve/main/big.gguf", None)]
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


@pytest.mark.parametrize("ref, needle", [
    ("nobody/nothing/x.gguf", "repository nobody/nothing not found"),
    (f"{REPO}/missing.gguf", f"{REPO} has no file 'missing.gguf'"),
])
def test_hub_not_found_is_one_line(env, hub, ref, needle):
    one_line_error(slipstream(env, "pull", ref), needle)
    one_line_error(slipstream(env, "run", "-m", ref, "-n", "1"), needle)


def test_hub_file_that_is_not_gguf_is_not_kept(env, hub, tmp_path):
    hub.repos[REPO]["fake.gguf"] = b"# not a model\n"
    one_line_error(slipstream(env, "pull", f"{REPO}/fake.gguf"), "is not a GGUF file")
    assert not (tmp_path / "cache" / "hf" / REPO / "fake.gguf").exists()


@pytest.mark.slow  # two interpreter starts: 2 s; the fast check is in test_cache_safety.py
def test_no_network_is_one_line(env, tmp_path):
    """Through the real process; its timing: test_cache_safety.py's offline Hub tests."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    one_line_error(slipstream(env | {"HF_ENDPOINT": dead}, "pull", f"{REPO}/{FILE}"),
                   f"cannot reach {dead}")
    one_line_error(slipstream(env, "pull", f"{dead}/files/{FILE}"), "cannot reach")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.gguf"))


def test_offline_with_nothing_cached_is_one_line(env, hub):
    off = env | {"HF_HUB_OFFLINE": "1"}
    one_line_error(slipstream(off, "pull", f"{REPO}/{FILE}"), "HF_HUB_OFFLINE is set")
    one_line_error(slipstream(off, "run", "-m", f"{REPO}/{FILE}"), "HF_HUB_OFFLINE is set")
    one_line_error(slipstream(off, "pull", f"{hub.url}/files/{FILE}"), "HF_HUB_OFFLINE is set")
    assert hub.log == []


def test_unknown_model_name_is_one_line(env):
    one_line_error(slipstream(env, "info", "-m", "no-such-model"),
                   "model 'no-such-model' does not exist", "slipstream list")


# --- plain URLs --------------------------------------------------------------------------

@pytest.mark.slow
def test_url_pull_list_and_m(env, hub, gguf_bytes, tmp_path):
    url = f"{hub.url}/files/{FILE}"
    r = slipstream(env, "pull", url)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert r.stdout == f"{path}\n" and path.read_bytes() == gguf_bytes
    assert path.is_relative_to(tmp_path / "cache" / "url")
    r = slipstream(env, "list")
    flat = " ".join(r.stdout.split())
    assert FILE in flat and url in flat
    hub.plain.clear()  # -m URL and -m NAME come from the cache
    for m in (url, FILE):
        r = slipstream(env, "info", "-m", m)
        assert r.returncode == 0 and "llama" in r.stdout, r.stderr
    r = slipstream(env, "rm", url)  # the URL names it too
    assert r.returncode == 0 and not path.exists(), r.stderr
    assert not path.with_name(path.name + ".source.json").exists()


def test_url_resumes_after_a_drop_within_one_pull(env, hub, gguf_bytes):
    half = len(gguf_bytes) // 2
    hub.drops, hub.drop_at = 1, half
    r = slipstream(env, "pull", f"{hub.url}/files/{FILE}")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes
    assert gets(hub) == [(f"/files/{FILE}", None), (f"/files/{FILE}", f"bytes={half}-")]


def test_url_resumes_an_interrupted_pull(env, hub, gguf_bytes, tmp_path):
    """A pull that gives up (the connection keeps dropping) leaves FILE.partial, which is no
    model (not listed, not used by -m); the next pull asks only for the rest."""
    url = f"{hub.url}/files/{FILE}"
    half = len(gguf_bytes) // 2
    hub.drops, hub.drop_at = 100, half
    one_line_error(slipstream(env, "pull", url), "run the same command again to resume")
    partial = next((tmp_path / "cache" / "url").rglob("*.partial"))
    assert partial.read_bytes() == gguf_bytes[:half]
    assert not list((tmp_path / "cache").rglob("*.gguf"))
    r = slipstream(env, "list")
    assert "1 unfinished download(s)" in r.stderr and "no models" in r.stderr
    one_line_error(slipstream(env | {"HF_HUB_OFFLINE": "1"}, "info", "-m", url),
                   "HF_HUB_OFFLINE")  # the partial is no model
    hub.drops, hub.log[:] = 0, []
    r = slipstream(env, "pull", url)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes and not partial.exists()
    assert gets(hub) == [(f"/files/{FILE}", f"bytes={half}-")]


def _kill_mid_download(env, hub, ref: str, partial_dir: Path, pattern: str) -> Path:
    """Start `slipstream pull REF`, wait until the server has sent hub.stall_at bytes and the
    downloader has written its whole chunks of them, SIGKILL it (no handler, no clean-up can
    run), and return the file it was writing."""
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", "pull", ref], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert hub.stalled.wait(60), "the pull never started downloading"
        # A write of a whole chunk can be seen part-way (CI once killed at 8 of 10 MiB): wait
        # until the file has stopped growing, the downloader being stalled by then.
        deadline, sizes = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            found = [p for p in partial_dir.rglob(pattern) if p.stat().st_size >= 4 << 20]
            sizes = sizes[-9:] + [found[0].stat().st_size if found else 0]
            if found and len(sizes) == 10 and len(set(sizes)) == 1:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"no {pattern} of 4 MiB under {partial_dir} that stopped "
                                 f"growing (sizes {sizes})")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate()
        hub.release.set()  # let the stalled handler finish
    return found[0]


@pytest.mark.slow
def test_url_resumes_a_pull_killed_mid_download(env, hub, tmp_path):
    """`slipstream pull URL` killed (SIGKILL) part-way keeps FILE.partial, whatever it had
    written; the next pull asks with a Range header for the bytes after it, and the file ends
    whole, byte for byte. (Its If-Range guard: test_url_starts_over_when_the_file_changed.)"""
    big = b"GGUF" + os.urandom((12 << 20) - 4)  # only the magic is checked
    hub.plain["big.gguf"] = big
    url = f"{hub.url}/files/big.gguf"
    hub.stall_at = (6 << 20) + 12345  # the downloader writes whole 1 MiB chunks: 6 MiB of it
    partial = _kill_mid_download(env, hub, url, tmp_path / "cache", "big.gguf.partial")
    kept = partial.read_bytes()
    assert 4 << 20 <= len(kept) <= hub.stall_at and kept == big[:len(kept)]
    hub.stall_at, hub.log[:] = 0, []
    r = slipstream(env, "pull", url)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(big).digest()
    assert gets(hub) == [("/files/big.gguf", f"bytes={len(kept)}-")]
    assert not partial.exists()


def test_url_starts_over_when_the_file_changed(env, hub, gguf_bytes, tmp_path):
    """If-Range: the partial belongs to the old file's ETag, so the server sends the whole
    new file and nothing of the old one survives."""
    url = f"{hub.url}/files/{FILE}"
    old = gguf_bytes[:-8] + b"oldtail!"
    hub.plain[FILE] = old
    hub.drops, hub.drop_at = 100, len(old) // 2
    one_line_error(slipstream(env, "pull", url), "resume")
    hub.plain[FILE], hub.drops = gguf_bytes, 0
    r = slipstream(env, "pull", url)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == gguf_bytes


@pytest.mark.slow
def test_url_errors_are_one_line(env, hub, tmp_path):
    one_line_error(slipstream(env, "pull", f"{hub.url}/files/missing.gguf"),
                   "does not exist (HTTP 404)")
    one_line_error(slipstream(env, "pull", f"{hub.url}/files/page.gguf"),
                   "is not a GGUF file", "<!DOCTYPE")
    assert not list((tmp_path / "cache").rglob("page.gguf*"))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["url", "hub"])
def test_a_full_disk_is_one_line(env, hub, monkeypatch, capsys, tmp_path, source):
    """In-process, with the free space faked (1000 bytes): refused before the file is
    written, for a URL by slipstream's own check, for the Hub by huggingface_hub's (a
    warning there, which slipstream makes an error)."""
    from slipstream import cli

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1000))
    ref = f"{hub.url}/files/{FILE}" if source == "url" else f"{REPO}/{FILE}"
    assert cli.main(["pull", ref]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out.err
    assert "not enough disk space" in out.err.replace("\n", " ")
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_every_model_command_resolves_m(env, gguf_bytes, monkeypatch):
    """run, chat, serve, info, bench and perplexity all take -m NAME: a cached model's name
    becomes its path before anything loads (no network: the model is in the cache)."""
    from slipstream.cli import build_parser, check_args
    from slipstream.hub import store

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = store.url_path(UrlRef("https://example.com/m/" + FILE))
    path.parent.mkdir(parents=True)
    path.write_bytes(gguf_bytes)
    for command in ("run", "chat", "serve", "info", "bench", "perplexity"):
        extra = ["-f", str(path)] if command == "perplexity" else []
        a = build_parser().parse_args([command, "-m", FILE[:-5], *extra])
        check_args(a)
        assert a.model == str(path), command


# --- names -------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_path_wins_and_a_shared_file_name_is_ambiguous(env, hub, gguf_bytes, tmp_path):
    local = tmp_path / FILE
    local.write_bytes(gguf_bytes)
    assert slipstream(env, "pull", f"{REPO}/{FILE}").returncode == 0
    assert slipstream(env, "pull", f"{hub.url}/files/{FILE}").returncode == 0
    one_line_error(slipstream(env, "rm", FILE), "names 2 cached models")
    r = subprocess.run([sys.executable, "-m", "slipstream", "info", "-m", FILE],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr  # ./tiny-Q8_0.gguf exists: the path wins
    assert slipstream(env, "rm", f"{REPO}/{FILE}").returncode == 0
    assert slipstream(env, "rm", FILE).returncode == 0  # unique now
    assert "no models" in slipstream(env, "list").stderr


def test_the_bar_follows_both_downloads(env, hub, gguf_bytes, monkeypatch):
    """slipstream's own rich bar: huggingface_hub's progress reaches it through the tqdm
    adaptor, the URL downloader's directly; each ends full, at the file's size."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    from slipstream.hub import hf, http, store

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with Progress(console=console) as bar:
        hf.download(HubRef(REPO, FILE), bar)
        url = UrlRef(f"{hub.url}/files/{FILE}")
        http.download(url.url, store.url_path(url), bar, FILE)
    assert [(t.description, t.completed, t.total) for t in bar.tasks] == [
        (FILE, len(gguf_bytes), len(gguf_bytes))] * 2
    assert console.file.getvalue().count("100%") >= 2  # drawn, on a terminal


def test_load_and_its_draft_take_a_cached_name(tmp_path, monkeypatch):
    """slipstream.load (and its draft=) take what -m takes: here a cached model's name, as
    `slipstream list` shows it; a name nothing answers to is ModelNotFound, before loading."""
    import slipstream as ss
    from slipstream.errors import ModelNotFound
    from slipstream.synth import write_synth

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_synth(cache / "tiny-target.gguf", "tiny", "Q8_0", n_layers=1)
    write_synth(cache / "tiny-draft.gguf", "tiny", "Q4_0", n_layers=1)
    with ss.load("tiny-target", device="cpu", ctx=64, draft="tiny-draft.gguf") as model:
        assert model.path == cache / "tiny-target.gguf"
        assert model.plan.draft is not None and model.plan.draft[0] == "tiny-draft.gguf"
        assert len(list(model.generate([1, 2, 3], max_tokens=4, temperature=0))) == 4
    with pytest.raises(ModelNotFound, match="no-such-model"):
        ss.load("no-such-model", device="cpu")
