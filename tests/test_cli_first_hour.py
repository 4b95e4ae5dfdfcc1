"""What a new user meets first, through the real `python -m slipstream` process:
help with every default, --version, arguments refused before anything loads, the prompt from
a file or stdin, -n -1, the timings line, and Ctrl-C in `run` and `chat` sent through a
pseudo-terminal, as a terminal sends it."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import termios
import threading
import time
from importlib.metadata import PackageNotFoundError, version

import pytest

import slipstream
from slipstream.cli import build_parser

PROMPT = "The capital of France is"
T1 = ("--device", "cpu", "-t", "1")  # one thread: the CI machine's cores are shared
TIMEOUT = 300  # a model load takes seconds on a free core, much longer on a busy one


def slipstream_cmd(*args: str, stdin: str | None = None, timeout: int = TIMEOUT,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def model(smollm_path):
    with slipstream.load(smollm_path, device="cpu", ctx=512) as m:
        yield m


def greedy(model, prompt: str, n: int) -> str:
    return "".join(e.text for e in model.generate(prompt, max_tokens=n, temperature=0))


SUMMARY = re.compile(r"load (?P<load>[\d.]+) s \| prompt (?P<prompt>\d+) tok in [\d.]+ ms "
                     r"\([\d.]+ tok/s\) \| generated (?P<gen>\d+) tok, decode [\d.]+ ms "
                     r"\([\d.]+ tok/s, [\d.]+ ms/tok\) \| total (?P<total>[\d.]+) s \| "
                     r"finish: (?P<finish>\w+)")


def summary_of(stderr: str) -> re.Match:
    m = SUMMARY.search(stderr)
    assert m, stderr
    return m


# --- help and arguments -------------------------------------------------------------------


def test_help_shows_the_defaults():
    r = slipstream_cmd("run", "--help", env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    lines: dict[str, str] = {}  # option -> its whole entry (the help may start a line below)
    flag = None
    for line in r.stdout.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            lines[flag] = line
        elif flag and line.startswith("   "):
            lines[flag] += " " + line.strip()
        else:
            flag = None
    want = {"-p": "(default: 'Once upon a time,')", "-n": "(default: 128)",
            "--temp": "(default: 0.8)", "--top-k": "(default: 40)", "--top-p": "(default: 0.95)",
            "--min-p": "(default: 0.05)", "--repeat-penalty": "(default: 1.0)",
            "--seed": "(default: a new one each run)", "-t": "(default: torch's choice"}
    for flag, text in want.items():
        assert text in lines[flag], lines[flag]
    assert "-1: until the end of text" in lines["-n"]


def test_every_option_of_every_command_says_its_default():
    """Options with a value (not flags like --stats) end their help with their default, or
    say in words what happens without them."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.choices and a.dest == "command").choices
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0:
                continue  # positionals, --help, store_true flags
            if action.required:
                continue
            text = formatter._expand_help(action)
            assert "default" in text, f"slipstream {name} {action.option_strings[0]}: {text}"


def test_version():
    r = slipstream_cmd("--version")
    try:
        expected = version("slipstream")
    except PackageNotFoundError:
        expected = slipstream.__version__
    assert r.returncode == 0 and r.stdout == f"slipstream {expected}\n"


@pytest.mark.parametrize("args, message", [
    (["run", "--temp", "-1"], "--temp -1.0 is invalid: must be >= 0"),
    (["run", "--temp", "nan"], "--temp nan is invalid: must be a finite number"),
    (["run", "--temp", "hot"], "argument --temp: invalid float value: 'hot'"),
    (["run", "--top-p", "2"], "--top-p 2.0 is invalid: must be in (0, 1]"),
    (["run", "--top-p", "0"], "--top-p 0.0 is invalid"),
    (["run", "--min-p", "1.5"], "--min-p 1.5 is invalid: must be in [0, 1]"),
    (["run", "--top-k", "-1"], "--top-k -1 is invalid"),
    (["run", "--repeat-penalty", "0"], "--repeat-penalty 0.0 is invalid: must be > 0"),
    (["run", "--seed", str(2**64)], f"--seed {2**64} is invalid"),
    (["chat", "-n", "0"], "-n 0 is invalid: must be >= 1, or -1"),
    (["run", "-n", "-5"], "-n -5 is invalid: must be >= 0 (0: prefill only), or -1"),
    (["chat", "-n", "0"], "-n 0 is invalid"),
    (["run", "--ctx", "0"], "--ctx 0 is invalid"),
    (["run", "-t", "0"], "--threads 0 is invalid: must be >= 1"),
    (["run", "--gpu-slots", "1"], "at least 2 GPU slots"),
    (["run", "-ngl", "-1"], "--vram-layers -1 is invalid"),
    (["run", "--device", "gpu"], "--device 'gpu' is not supported"),
    (["run", "-p", "x", "-f", "prompt.txt"], "give the prompt with -p or with -f, not both"),
    (["run", "-f", "missing.txt"], "cannot read the prompt from 'missing.txt'"),
    (["run", "--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    (["bench", "--tg", "0"], "--tg 0 is invalid"),
    (["perplexity", "-f", "t.txt", "--chunks", "0"], "--chunks 0 is invalid"),
    (["serve", "--port", "70000"], "--port 70000 is invalid"),
    (["serve", "--max-queue", "-1"], "--max-queue -1 is invalid"),
    (["serve", "--max-tokens-default", "0"], "--max-tokens-default 0 is invalid"),
])
def test_bad_arguments_fail_before_loading(tmp_path, args, message):
    """One line, exit 1, no traceback. The model named does not exist: an error that waited
    for the load would name it instead."""
    (tmp_path / "prompt.txt").write_text("hello")
    command, *rest = args
    r = subprocess.run([sys.executable, "-m", "slipstream", command, "-m",
                        str(tmp_path / "missing.gguf"), *rest], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error:"), r.stderr
    assert message in r.stderr and r.stdout == ""


def test_a_missing_model_is_one_line_before_imports(tmp_path):
    r = slipstream_cmd("run", "-m", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "does not exist" in r.stderr


def imported_modules(*args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The modules `python -m slipstream ARGS` imports (python -X importtime)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "slipstream", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    modules = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
               if line.startswith("import time:")}
    assert "slipstream.cli" in modules  # the measurement works
    return modules, r


def test_help_does_not_import_torch():
    """`--help` starts in a fraction of a second: the API (and torch) load only for the
    commands that run a model."""
    for args in (["--help"], ["run", "--help"], ["serve", "--help"]):
        assert "torch" not in imported_modules(*args)[0], args


def test_help_imports_neither_gguf_nor_the_downloaders():
    """The parser alone: the GGUF reader (and numpy under it) and the network stack wait for
    a command that reads a file or downloads one."""
    modules = imported_modules("--help")[0]
    assert not modules & {"gguf", "numpy", "ssl", "urllib.request", "http.client",
                          "slipstream.hub.hf", "slipstream.hub.http"}, modules


def test_info_does_not_import_torch(smollm_path):
    modules, r = imported_modules("info", "-m", str(smollm_path))
    assert "torch" not in modules
    assert "Q4_1" in r.stdout and "tied embeddings" in r.stdout and "True" in r.stdout


# --- the prompt from a file or stdin, -n -1, the summary line -----------------------------


@pytest.mark.slow
def test_prompt_from_file_and_stdin_until_the_context_is_full(smollm_path, tmp_path, model):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n")  # the trailing newline an editor adds is dropped
    # --raw: the prompt as text, not through the model's chat template (which alone would
    # take more than the 24 tokens of context)
    common = ("run", "-m", str(smollm_path), *T1, "--ctx", "24", "-n", "-1", "--temp", "0",
              "--raw")
    from_file = slipstream_cmd(*common, "-f", str(prompt_file))
    from_stdin = slipstream_cmd(*common, "-p", "-", stdin=PROMPT + "\n")
    for r in (from_file, from_stdin):
        assert r.returncode == 0, r.stderr
    assert from_file.stdout == from_stdin.stdout
    s = summary_of(from_file.stderr)
    prompt_tokens, generated = int(s["prompt"]), int(s["gen"])
    assert prompt_tokens == len(model.tokenize(PROMPT))
    # -n -1: until the end of text or the context (24 tokens) is full
    assert s["finish"] == "stop" or prompt_tokens + generated == 24, s.group(0)
    assert from_file.stdout == greedy(model, PROMPT, generated) + "\n"
    assert float(s["total"]) >= float(s["load"]) > 0


@pytest.mark.slow
def test_threads_flag_sets_torchs_threads(smollm_path, tmp_path):
    import json

    out = tmp_path / "bench.json"
    r = slipstream_cmd("bench", "-m", str(smollm_path), "--device", "cpu", "-t", "1", "--pp",
                       "8", "--tg", "2", "--reps", "1", "--json", str(out),
                       env={"OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["threads"] == 1


# --- Ctrl-C through a pseudo-terminal -------------------------------------------------------


class Terminal:
    """`python -m slipstream ARGS` with a pseudo-terminal as its stdin and controlling
    terminal (so that writing ^C to it sends SIGINT, ^D ends a line with EOF), and stdout and
    stderr collected apart."""

    def __init__(self, *args: str):
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[3] |= termios.ICANON | termios.ISIG
        attrs[3] &= ~termios.ECHO  # keep typed text out of the way
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.master = master
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream", *args], stdin=slave, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.out, self.err = bytearray(), bytearray()
        self.readers = [threading.Thread(target=self._read, args=(f, buf), daemon=True)
                        for f, buf in ((self.proc.stdout, self.out), (self.proc.stderr,
                                                                         self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(f, buf: bytearray) -> None:
        while chunk := f.read1(4096):
            buf.extend(chunk)

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", errors="replace")

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait_for(self, what: str, condition, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"waiting for {what}: exit {self.proc.returncode}\n"
                            f"stdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-3000:]}")
            time.sleep(0.02)

    def prompts(self) -> int:
        return self.stderr.count("> ")

    def wait_prompt(self, n: int) -> None:
        """Until the n-th "> " prompt; then the process waits for input, its output settled."""
        self.wait_for(f"prompt {n}", lambda: self.prompts() >= n)
        time.sleep(0.3)  # what it wrote to stdout before the prompt is read by now

    def exit_code(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for t in self.readers:
            t.join(10)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


@pytest.mark.slow
def test_ctrl_c_in_run_prints_the_summary(smollm_path, model):
    term = Terminal("run", "-m", str(smollm_path), *T1, "--ctx", "512", "-n", "400",
                    "--temp", "0", "--raw", "-p", "Once upon a time, in a land far away,")
    try:
        term.wait_for("generated text", lambda: len(term.stdout.strip()) >= 12)
        term.type(b"\x03")
        assert term.exit_code() == 130
    finally:
        term.close()
    s = summary_of(term.stderr)
    assert s["finish"] == "interrupted" and 0 < int(s["gen"]) < 400, s.group(0)
    assert "Traceback" not in term.stderr
    text = term.stdout.removesuffix("\n")
    # what was printed is the start of the generation, up to where it stopped
    assert greedy(model, "Once upon a time, in a land far away,", int(s["gen"])).startswith(text)


@pytest.fixture(scope="module")
def exact_model(smollm_path):
    with slipstream.load(smollm_path, device="cpu", ctx=512, precision="exact") as m:
        yield m


@pytest.mark.slow
def test_ctrl_c_in_chat_stops_the_reply_and_keeps_the_conversation(smollm_path, exact_model):
    """At precision exact on both sides: the chat continues its KV cache while the check below
    prefills the whole conversation, and at "fast" decoded and prefilled tokens go through
    different kernels (packed copies for decode), which can part greedy text."""
    model = exact_model
    n = 64
    first = "My name is Ada. Tell me a long story about a dragon."
    term = Terminal("chat", "-m", str(smollm_path), *T1, "--ctx", "512", "-n", str(n),
                    "--temp", "0", "-v", "--precision", "exact")
    try:
        term.wait_prompt(1)
        term.type(first.encode() + b"\n")
        term.wait_for("the reply", lambda: len(term.stdout.strip()) >= 12)
        term.type(b"\x03")  # mid-reply: back to the prompt, not out of the program
        term.wait_prompt(2)
        partial = term.stdout.removesuffix("\n")
        summary_line = next(line for line in term.stderr.splitlines() if "finish:" in line)
        assert "finish: interrupted" in summary_line, term.stderr
        generated = int(re.search(r"generated (\d+) tok", summary_line)[1])
        assert generated < n

        term.type(b"What is my name?\n")
        term.wait_prompt(3)
        second = term.stdout[len(partial) + 1:].removesuffix("\n")

        term.type(b"\x03")  # at the idle prompt: how to quit
        term.wait_for("the hint", lambda: "Ctrl-C again, Ctrl-D or /bye quits" in term.stderr)
        assert term.proc.poll() is None
        term.type(b"\x04")  # Ctrl-D at the start of a line: EOF
        assert term.exit_code() == 0
    finally:
        term.close()
    assert "Traceback" not in term.stderr
    messages = [{"role": "user", "content": first}]
    full = "".join(e.text for e in model.chat(messages, max_tokens=generated, temperature=0))
    assert partial and full.startswith(partial)
    # the stopped reply stayed in the conversation as far as it went
    messages += [{"role": "assistant", "content": partial},
                 {"role": "user", "content": "What is my name?"}]
    assert second == "".join(e.text for e in model.chat(messages, max_tokens=n, temperature=0))


@pytest.mark.slow
def test_two_ctrl_c_at_the_prompt_quit(smollm_path):
    term = Terminal("chat", "-m", str(smollm_path), *T1, "--ctx", "64")
    try:
        term.wait_prompt(1)
        term.type(b"\x03")
        term.wait_for("the hint", lambda: "Ctrl-C again" in term.stderr)
        term.type(b"\x03")
        assert term.exit_code() == 0
    finally:
        term.close()
    assert "Traceback" not in term.stderr and term.stdout == ""
