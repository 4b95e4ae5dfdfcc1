"""One chat-template render process: `python -m slipstream.modelfile.template_worker LIMIT`.

The server renders a model's chat template in processes like this one (server/templates.py
keeps a pool of them), because a template is code from the model file and the sandbox in
chat_template.py cannot bound everything: a filter or str method whose result grows with an
argument (`' '.center(10**9)`, a format width) allocates about 1 GB in one call, and a list
of 16M-character strings grown in a `namespace` over a loop passes every size check while it
takes GBs. In a process of its own, under an address-space limit (RLIMIT_AS, LIMIT bytes),
such an allocation fails here with a MemoryError, and the server's own memory never sees it.

The process is fresh (no fork of the server, which holds torch and threads) and imports only
jinja2, tokenizers and this package's light modules: it starts in about 0.2 s and 27 MB.

Protocol, over stdin and stdout: frames of a 4-byte big-endian length and UTF-8 JSON. JSON,
not pickle: the parent reads what a hostile template influenced, and JSON cannot run code.
    parent -> {"source": str | None, "special_tokens": {...}}    the template, once
    worker -> {"ready": start seconds}                           compiled
    parent -> {"messages": [...], "add_generation_prompt": bool}
    worker -> {"text": str} | {"error": KIND, "message": str}    KIND in ERROR_KINDS
The worker exits when stdin closes (its parent is gone or done with it).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import time
from typing import Any, BinaryIO

from ..errors import ChatTemplateLimitExceeded, TokenizerError
from .chat_template import ChatTemplate

# what a failed render was: a bound of the sandbox, the address-space limit, or the template's
# own failure (raise_exception, a TypeError, ...)
ERROR_KINDS = ("limit", "memory", "render")
_HEADER = struct.Struct(">I")
NICENESS = 10  # a render yields the CPU to generation on a busy host


def encode_frame(obj: Any) -> bytes:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _HEADER.pack(len(data)) + data


def decode_payload(data: bytes) -> Any:
    """A frame's object from its bytes after the length."""
    return json.loads(data.decode("utf-8", "surrogatepass"))


def take_frame(buffer: bytearray) -> bytes | None:
    """The first whole frame's payload, removed from `buffer`; None while it is incomplete."""
    if len(buffer) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack_from(buffer)
    end = _HEADER.size + n
    if len(buffer) < end:
        return None
    payload = bytes(buffer[_HEADER.size:end])
    del buffer[:end]
    return payload


def write_frame(stream: BinaryIO, obj: Any) -> None:
    stream.write(encode_frame(obj))
    stream.flush()


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's object; None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    data = stream.read(n)
    if len(data) < n:
        return None
    return decode_payload(data)


def render_one(template: ChatTemplate, request: dict[str, Any]) -> dict[str, Any]:
    """The reply to one render request: the text, or what went wrong."""
    try:
        text = template.render(request["messages"],
                               add_generation_prompt=request.get("add_generation_prompt", True))
        return {"text": text}
    except ChatTemplateLimitExceeded as e:
        return {"error": "limit", "message": str(e)}
    except TokenizerError as e:
        if isinstance(e.__cause__, MemoryError):
            return {"error": "memory", "message": "MemoryError"}
        return {"error": "render", "message": str(e)}
    except MemoryError:  # outside the render's own handling (building the reply, ...)
        return {"error": "memory", "message": "MemoryError"}


def limit_memory(limit: int) -> None:
    """Cap this process's address space at `limit` bytes (at least what it maps already)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError) as e:  # macOS refuses RLIMIT_AS: only the time limit holds
        print(f"slipstream template worker: no memory limit ({e})", file=sys.stderr)


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    limit = int(argv[0])
    # stdout is the channel: anything else printing there would corrupt a frame
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    source = sys.stdin.buffer
    try:
        os.nice(NICENESS)
    except OSError:  # not permitted in some containers: render at the same priority
        pass
    setup = read_frame(source)
    if setup is None:
        return 0
    limit_memory(limit)  # after the imports, which the limit must not fail
    try:
        template = ChatTemplate(setup.get("source"), **setup.get("special_tokens", {}))
    except TokenizerError as e:  # the template does not compile: every render says so
        write_frame(channel, {"ready": time.perf_counter() - t0, "error": "render",
                              "message": str(e)})
        return 0
    write_frame(channel, {"ready": time.perf_counter() - t0})
    while (request := read_frame(source)) is not None:
        reply = render_one(template, request)
        try:
            write_frame(channel, reply)
        except MemoryError:
            write_frame(channel, {"error": "memory", "message": "MemoryError"})
        if "error" in reply and reply["error"] == "memory":
            return 0  # a heap that hit the limit may stay fragmented: the parent starts anew
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
