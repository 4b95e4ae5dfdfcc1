"""OpenAI's response and stream-chunk shapes for completions and chat completions.

Streams are server-sent events: one `data: {json}` line per chunk and a blank line, ending with
`data: [DONE]`. A chat stream opens with a chunk whose delta carries the role, then content
deltas, then a chunk with an empty delta and the finish_reason; with
`stream_options.include_usage` every chunk has `"usage": null` and one last chunk with no choices
carries the usage.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .worker import Done

DONE_LINE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


@dataclass
class Formatter:
    """Builds the bodies of one request (one id and creation time for all its chunks)."""

    chat: bool
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, done: Done) -> dict[str, Any]:
        """The whole (non-streamed) answer."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "refusal": None},
                      "logprobs": None, "finish_reason": done.finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": done.finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(done)
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              role: bool = False) -> str:
        """One stream chunk as an SSE event."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, done: Done) -> str:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(done)
        return sse(body)
