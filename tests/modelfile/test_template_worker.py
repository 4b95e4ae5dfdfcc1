"""The chat-template render process's side (modelfile/template_worker.py) and what compiling
a template may allocate."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import pytest

from slipstream.modelfile.chat_template import ChatTemplate
from slipstream.modelfile.template_worker import (decode_payload, encode_frame, read_frame,
                                                  render_one, take_frame, write_frame)

HUGE = 10**8  # characters: 100 MB if anything computed it


@pytest.mark.parametrize("source", [
    "{{ '%*s' % (" + str(HUGE) + ", 'x') }}",
    "{{ 'x' | center(" + str(HUGE) + ") }}",
    "{% set y = 'x' | center(" + str(HUGE) + ") %}{{ y | length }}",
    "{% if ('x' * 3) | center(" + str(HUGE) + ") %}yes{% endif %}",
])
def test_compiling_computes_no_constant_expression(source):
    """Jinja folds constant expressions while it compiles, outside every bound of a render:
    these took 100 MB (2.3 GB at 3*10**8) before a model was even served."""
    tracemalloc.start()
    try:
        template = ChatTemplate(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < HUGE // 10, f"compiling took {peak:,} bytes"
    consts = template._template.root_render_func.__code__.co_consts
    assert max(len(c) for c in consts if isinstance(c, str)) < 100  # no folded text


def test_frames_round_trip_in_pieces():
    objs = [{"text": "héllo 😀 \udc80"}, {"error": "limit", "message": "m"}, {"ready": 0.25}]
    stream = b"".join(encode_frame(o) for o in objs)
    buffer, out = bytearray(), []
    for i in range(0, len(stream), 3):  # as os.read may deliver them: a few bytes at a time
        buffer += stream[i:i + 3]
        while (payload := take_frame(buffer)) is not None:
            out.append(decode_payload(payload))
    assert out == objs and not buffer


@pytest.mark.parametrize("source,kind,words", [
    ("{{ raise_exception('roles must alternate') }}", "render", "roles must alternate"),
    ("{% for i in range(10**9) %}{% endfor %}", "limit", "more than 100,000 items"),
    ("{{ messages[0].content | upper }}", None, "HI"),
])
def test_render_one_names_what_went_wrong(source, kind, words):
    reply = render_one(ChatTemplate(source), {"messages": [{"role": "user", "content": "hi"}]})
    if kind is None:
        assert reply == {"text": "HI"}
    else:
        assert reply["error"] == kind and words in reply["message"]


def test_the_process_renders_under_its_memory_limit_and_exits_after_running_out():
    """The real process: a 1 GB allocation fails under a 256 MiB limit, the worker says so
    and exits (its heap is not reused); a plain render before it works."""
    proc = subprocess.Popen([sys.executable, "-m", "slipstream.modelfile.template_worker",
                             str(256 << 20)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        write_frame(proc.stdin, {"source": "{% if messages[0].content == 'big' %}"
                                           "{{ ' '.center(10**9) }}{% else %}ok{% endif %}",
                                 "special_tokens": {}})
        assert "ready" in read_frame(proc.stdout)
        write_frame(proc.stdin, {"messages": [{"role": "user", "content": "small"}]})
        assert read_frame(proc.stdout) == {"text": "ok"}
        write_frame(proc.stdin, {"messages": [{"role": "user", "content": "big"}]})
        assert read_frame(proc.stdout) == {"error": "memory", "message": "MemoryError"}
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
