"""Ctrl-C in the middle of a long prefill, through a pseudo-terminal: `slipstream run` stops
after the layer it is computing, prints its one summary line and exits 130, resident and
streamed from disk, instead of finishing the prompt first."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import termios
import threading
import time

import pytest

from slipstream.synth import write_synth

LOAD_TIMEOUT = 300  # a model load takes seconds on a free core, much longer on a busy one
# A prefill here: 96 layers over ~1250 tokens. Through the packed prefill kernels ~400 tokens
# took 0.97 s streamed at -t 1 (load average 3), within the second the test waits before its
# Ctrl-C, so the prompt is three times that: ~3 s and 0.03 s a layer on a free core, 0.1-0.3 s
# a layer on a busy one, so a stop at the next layer comes well within 1 s.
PROMPT = "the quick brown fox jumps over the lazy dog " * 48


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    d = tmp_path_factory.mktemp("ctrl_c_prefill")
    path = write_synth(d / "deep.gguf", "tiny", "Q4_K", n_layers=96, from_floats=True,
                       std=0.08, seed=3)
    (d / "prompt.txt").write_text(PROMPT)
    return path


def _reader(f, buf: bytearray) -> None:
    while chunk := f.read1(4096):
        buf.extend(chunk)


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_ctrl_c_stops_a_long_prefill_within_a_second(deep, streamed):
    from helpers import cpu_budget

    args = ["run", "-m", str(deep), "--device", "cpu", "-t", "1", "--ctx", "2048", "-n", "4",
            "--temp", "0", "--stats", "-f", str(deep.with_name("prompt.txt"))]
    if streamed:  # every layer read from disk during the prefill
        args += ["--ram-budget", str(cpu_budget(deep, ctx=2048))]
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] |= termios.ICANON | termios.ISIG  # ^C written to the terminal is a SIGINT
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", *args], stdin=slave,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    out, err = bytearray(), bytearray()
    readers = [threading.Thread(target=_reader, args=a, daemon=True)
               for a in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        # --stats prints the tier plan once the model is loaded; the prefill follows at once
        deadline = time.monotonic() + LOAD_TIMEOUT
        while b"tier plan" not in err:
            assert proc.poll() is None and time.monotonic() < deadline, err.decode()
            time.sleep(0.02)
        time.sleep(1.0)  # into the prefill
        assert proc.poll() is None, err.decode()
        before = len(err)
        os.write(master, b"\x03")
        sent = time.monotonic()
        while b"finish:" not in err[before:] and proc.poll() is None:
            time.sleep(0.005)
        summary_at = time.monotonic() - sent
        code = proc.wait(30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    for t in readers:
        t.join(10)
    after = err[before:].decode().strip().splitlines()
    assert code == 130, err.decode()
    assert took < 1.0, f"exited {took:.2f} s after Ctrl-C (summary at {summary_at:.2f} s)"
    # one line: the summary, of a prefill stopped before its first token
    assert len(after) == 1 and "finish: interrupted" in after[0], after
    assert "generated 0 tok" in after[0], after
    assert out.decode().strip() == ""
