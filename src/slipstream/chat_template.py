"""Render a GGUF's chat template (`tokenizer.chat_template`) into a prompt string.

The template is Jinja written for Hugging Face's `apply_chat_template`, so we render it in the same
environment: sandboxed, `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson`
that does not escape HTML, and the `raise_exception`/`strftime_now` helpers templates call. A
file without a template gets plain ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TokenizerError
from .tokenizer import special_token_id

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (HF marks assistant spans with it) and
    renders the body unchanged; we have no use for the span indices."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str | None = None, *, bos_token: str = "", eos_token: str = "",
                 unk_token: str | None = None, pad_token: str | None = None) -> None:
        self.is_fallback = not source
        self.source = source or CHATML_TEMPLATE
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token,
                               "unk_token": unk_token, "pad_token": pad_token}
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template does not compile: {e}") from e

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> ChatTemplate:
        tokens = md.get("tokenizer.ggml.tokens") or ()

        def text(name: str) -> str | None:
            token_id = special_token_id(md, name)
            return tokens[token_id] if token_id is not None else None

        return cls(md.get("tokenizer.chat_template"), bos_token=text("bos") or "",
                   eos_token=text("eos") or "", unk_token=text("unknown"), pad_token=text("padding"))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt for `messages` (dicts with `role` and `content`). Extra keyword arguments
        (`tools`, `enable_thinking`, ...) are passed to the template, as HF does."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed to render: {e}") from e
