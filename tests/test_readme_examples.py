"""Every ```bash and ```python block of README.md, run as written (each within a minute
on the 2-core CI machine; the server ones included).

A block runs unless the HTML comment on the line right before its fence says otherwise:

    <!-- example: after-install -->          its `pip install ...` lines (and `pip install ... &&`
                                             prefixes) are what .ci/run did before pytest; the
                                             rest runs
    <!-- example: skip: REASON -->           not run, for REASON
    <!-- example: needs-gpu -->              runs only where CUDA is
    <!-- example: files NAME=TYPE ... -->     the user's own files: the test first makes NAME in
                                             the block's directory with `slipstream quantize`
                                             from the default model (TYPE: Q8_0, Q4_0, ...)
    <!-- example: server -->                 `slipstream serve`, started in the background until
                                             /health answers 200; the `client` blocks then run
                                             against it, and it is stopped
    <!-- example: client -->                 runs against that server

Every bash line (continuations joined) is one command with its own 60 s limit, run by
`bash -eo pipefail -c` in a fresh directory; a python block is one script (`python3 FILE`) with
the same limit. Nothing downloads: HOME is a temp directory and SLIPSTREAM_CACHE a temp cache
holding a symlink to the default model (pulled once by the `smollm_path` fixture), so an
example naming any other model needs a `files` marker: tests/test_readme_files.py checks that,
in the fast tier, without running anything.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest

from slipstream.errors import ModelNotFound

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LIMIT_S = 60.0  # every README example finishes within a minute
TAGS = {"after-install", "server", "client", "needs-gpu"}
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->\s*$")
FILE_SPEC = re.compile(r"^([\w.-]+\.gguf)=(\w+)$")
DURATIONS: list[tuple[str, str, float]] = []  # (block, command, seconds), printed at the end


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    tags: set[str] = field(default_factory=set)
    files: dict[str, str] = field(default_factory=dict)  # name -> quant type
    skip: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang}"

    def commands(self) -> list[str]:
        """The block's commands as a user would type them: bash lines (continuations joined),
        or the whole python block as one script; after-install drops the pip lines."""
        if self.lang == "python":
            return [self.code]
        cmds, cur = [], ""
        for raw in self.code.splitlines():
            cur += raw
            if cur.endswith("\\"):
                cur = cur[:-1] + " "
                continue
            if cur.strip():
                cmds.append(cur.strip())
            cur = ""
        if "after-install" in self.tags:
            kept = []
            for c in cmds:
                parts = [p for p in c.split(" && ") if not p.strip().startswith("pip install")]
                if parts:
                    kept.append(" && ".join(parts))
            cmds = kept
        return cmds


def parse_readme(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        if lang in ("bash", "python"):
            b = Block(start + 1, lang, "\n".join(lines[start + 1:j]) + "\n")
            marker = MARKER.match(lines[start - 1]) if start > 0 else None
            if marker:
                _read_marker(b, marker.group(1))
            blocks.append(b)
        i = j + 1
    return blocks


def _read_marker(b: Block, spec: str) -> None:
    if spec.startswith("skip"):
        b.skip = spec[len("skip"):].lstrip(":").strip()
        if not b.skip:
            b.errors.append("a skip marker must give its reason")
        return
    for word in spec.split():
        f = FILE_SPEC.match(word)
        if f:
            b.files[f.group(1)] = f.group(2)
        elif word == "files":
            continue
        elif word in TAGS:
            b.tags.add(word)
        else:
            b.errors.append(f"unknown word {word!r} in the example marker")


BLOCKS = parse_readme(README.read_text())
PLAIN = [b for b in BLOCKS if not b.tags & {"server", "client"}]
CLIENTS = [b for b in BLOCKS if "client" in b.tags]


def test_readme_blocks_parse():
    """The parser sees the README's examples, and every marker means something: a typo in a
    marker must not quietly skip or change an example."""
    assert len(BLOCKS) >= 10, [b.id for b in BLOCKS]
    assert sum(b.lang == "python" for b in BLOCKS) >= 2
    assert [b.id for b in BLOCKS if "server" in b.tags] and CLIENTS
    bad = [f"{b.id}: {e}" for b in BLOCKS for e in b.errors]
    assert not bad, bad
    for b in BLOCKS:
        assert b.skip or b.commands(), f"{b.id} has nothing to run and no skip reason"


def test_quick_start_install_effect():
    """The README's `pip install -e ".[test]"` is tested by what it leaves, not by running it
    here: every test requirement is installed and `slipstream` runs this checkout."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    import slipstream

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    missing = []
    for req in extra:
        name = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"test requirements not installed: {missing}"
    assert shutil.which("slipstream"), "the slipstream console script is not on PATH"
    assert Path(slipstream.__file__).resolve().is_relative_to(ROOT / "src")
    out = subprocess.run(["slipstream", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and slipstream.__version__ in out.stdout, out


# --- running ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model(request) -> Path:
    try:
        return request.getfixturevalue("smollm_path")
    except ModelNotFound as e:
        pytest.skip(f"the default model cannot be fetched: {e}")


@pytest.fixture(scope="module")
def env(default_model, tmp_path_factory) -> dict[str, str]:
    """A fresh user's environment: an empty HOME, and a cache that holds only the default model
    (a symlink to the one the suite pulled), so no example downloads anything."""
    base = tmp_path_factory.mktemp("readme-env")
    (base / "home").mkdir()
    cache = base / "cache"
    cache.mkdir()
    (cache / default_model.name).symlink_to(default_model)
    e = dict(os.environ)
    e.update(HOME=str(base / "home"), SLIPSTREAM_CACHE=str(cache), HF_HUB_OFFLINE="1",
             NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return e


@pytest.fixture(scope="module")
def made_files(default_model, env, tmp_path_factory):
    """The user's files the markers name, each made once, with slipstream's own quantize."""
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("readme-files")

    def get(qtype: str) -> Path:
        if qtype not in made:
            dst = root / f"default-{qtype.lower()}.gguf"
            r = subprocess.run(["slipstream", "quantize", str(default_model), str(dst), qtype],
                               env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"quantize {qtype}: {r.stderr[-2000:]}"
            made[qtype] = dst
        return made[qtype]

    return get


@pytest.fixture(scope="module", autouse=True)
def _report_durations(request):
    yield
    if not DURATIONS:
        return
    plugins = request.config.pluginmanager
    tr, cap = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if tr is None or cap is None:
        return
    with cap.global_and_fixture_disabled():  # to the terminal, not into a captured teardown
        tr.write_line("")
        tr.write_line(f"README examples (limit {LIMIT_S:.0f} s each):")
        for block, cmd, secs in DURATIONS:
            lines = cmd.strip().splitlines()
            first = f"[python, {len(lines)} lines] {lines[0]}" if len(lines) > 1 else lines[0]
            tr.write_line(f"  {block:12s} {secs:6.1f} s  {first[:90]}")


def _workdir(tmp_path: Path, block: Block, made_files) -> Path:
    for name, qtype in block.files.items():
        (tmp_path / name).symlink_to(made_files(qtype))
    return tmp_path


def _run(block: Block, cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One command (or python script) in its own process group, so that a timeout kills all of it."""
    if block.lang == "python":
        script = cwd / f"example_{block.line}.py"
        script.write_text(cmd)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-eo", "pipefail", "-c", cmd]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=LIMIT_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        timed_out = True
    secs = time.monotonic() - t0
    DURATIONS.append((block.id, cmd, secs))
    head = (f"README {block.id}, {secs:.1f} s (limit {LIMIT_S:.0f} s), exit {p.returncode}:\n"
            f"{cmd}\n--- stderr (tail) ---\n{err[-3000:]}\n--- stdout (tail) ---\n{out[-1500:]}")
    assert not timed_out, "timed out: " + head
    assert p.returncode == 0, head
    assert (out + err).strip(), "printed nothing: " + head
    if re.match(r"slipstream run\b", cmd):
        # the run's summary line: it generated and ended on its own terms
        assert re.search(r"generated \d+ tok.*\| finish: (stop|length)", err), head
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


@pytest.mark.parametrize("block", PLAIN, ids=lambda b: b.id)
def test_readme_example(block: Block, env, made_files, tmp_path):
    if block.skip:
        pytest.skip(f"README {block.id}: {block.skip}")
    if "needs-gpu" in block.tags:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"README {block.id}: needs a CUDA GPU")
    cwd = _workdir(tmp_path, block, made_files)
    for cmd in block.commands():
        _run(block, cmd, cwd, env)


# --- the server and its clients -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(env, tmp_path_factory):
    """The README's `slipstream serve`, as written but on a free port (`--port N` appended):
    8080 may be taken on a shared machine. The client blocks get that port in place of 8080,
    and nothing else of them changes."""
    import httpx

    (block,) = [b for b in BLOCKS if "server" in b.tags]
    (cmd,) = block.commands()
    argv = cmd.split("#")[0].split()
    assert argv[:2] == ["slipstream", "serve"] and "--port" not in argv, cmd
    port = _free_port()
    log = tmp_path_factory.mktemp("readme-serve") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", f"exec {cmd.split('#')[0].strip()} --port {port}"],
                                env=env, cwd=log.parent, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    ready = False
    try:
        while time.monotonic() - t0 < LIMIT_S and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    ready = True
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        secs = time.monotonic() - t0
        DURATIONS.append((block.id, f"{cmd} --port {port}  (until /health 200)", secs))
        assert ready, (f"README {block.id}: `{cmd}` not healthy within {LIMIT_S:.0f} s "
                       f"(exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        yield port, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@pytest.mark.parametrize("block", CLIENTS, ids=lambda b: b.id)
def test_readme_client_example(block: Block, server, env, tmp_path):
    port, proc = server
    for cmd in block.commands():
        assert "127.0.0.1:8080" in cmd, f"README {block.id}: a client that names no server: {cmd}"
        r = _run(block, cmd.replace("127.0.0.1:8080", f"127.0.0.1:{port}"), tmp_path, env)
        assert r.stdout.strip(), f"README {block.id}: no answer on stdout:\n{cmd}"
        assert '{"error"' not in r.stdout, f"README {block.id}: {r.stdout[-2000:]}"
    assert proc.poll() is None, f"the server exited ({proc.returncode}) during README {block.id}"
