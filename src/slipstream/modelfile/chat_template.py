"""Render a GGUF's chat template (`tokenizer.chat_template`) into a prompt string.

The template is Jinja written for Hugging Face's `apply_chat_template`, so we render it in the same
environment: sandboxed, `trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson`
that does not escape HTML, and the `raise_exception`/`strftime_now` helpers templates call. A
file without a template gets plain ChatML.

A template is code from the model file, so one render is bounded (ChatTemplateLimitExceeded,
a TokenizerError, past a bound): range() sizes, loop iterations plus calls, time, and the size
of what it builds (strings and lists from `*`, `+` and `~`, integers from `*` and `**`, the text
of a macro, a `{% set %}` block and the whole output). Not bounded: a filter or str method whose
result grows with an argument (`center(N)`, a format width, `replace`) can still allocate that
much once; the loop bounds keep it from doing so without end.
"""

from __future__ import annotations

import json
import reprlib
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateLimitExceeded, TokenizerError
from .vocab import special_token_id

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Bounds on one render. Real templates stay far below them: SmolLM2's takes a few steps and a
# few hundred characters per message.
MAX_RANGE = 100_000  # items in one range() (templates count messages with it)
MAX_STEPS = 250_000  # loop iterations plus calls: under a second of Jinja, macro calls too
MAX_CHARS = 16 << 20  # items of a string or list the template builds, its output included
MAX_INT_BITS = 1 << 16  # size of an integer it computes with `*` or `**`
RENDER_TIMEOUT_S = 5.0  # for steps made slow by big strings, which MAX_STEPS alone lets by

# what a template can raise while it renders, besides our own bounds: each is its failure
_RENDER_FAILURES = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError,
                    RecursionError, MemoryError)


@dataclass
class _Budget:
    """What one render has left; counted down by every loop iteration and call."""

    steps: int
    deadline: float

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise ChatTemplateLimitExceeded(
                f"the chat template ran more than {MAX_STEPS:,} loop iterations and calls in "
                f"one render: it loops without end, or nearly")
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitExceeded(
                f"the chat template ran for more than {RENDER_TIMEOUT_S:g} s in one render")


# per thread and per render: the server renders on a worker thread, API users on any
_budget: ContextVar[_Budget | None] = ContextVar("slipstream_chat_template_budget",
                                                 default=None)


def _step() -> None:
    budget = _budget.get()
    if budget is not None:  # None: compiling, or a render outside ChatTemplate.render
        budget.step()


def _show(value: Any) -> str:
    """A value for a message, short: a huge int or string would make the message the problem
    (and a list of a few 16M-character strings, repr'd whole, a copy of them all)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an int of {value.bit_length():,} bits>"
    if isinstance(value, (str, list, tuple)) and len(value) > 40:
        return f"<a {type(value).__name__} of {len(value):,} items>"
    return _SHORT.repr(value)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def _too_big(what: str) -> ChatTemplateLimitExceeded:
    return ChatTemplateLimitExceeded(f"the chat template computes {what}")


def _check_size(value: Any, what: str) -> Any:
    """`value`, unless it is a string or list longer than MAX_CHARS."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_CHARS:
        raise _too_big(f"{what} of {len(value):,} items, more than {MAX_CHARS:,}")
    return value


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before it is computed, a product, power or concatenation whose result would
    pass the bounds: computing `'x' * 10**12` first is the blow-up itself."""
    def expr() -> str:  # only for the message: this runs on every `*`, `**` and `+`
        return f"{_show(left)} {operator} {_show(right)}"

    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0:
        bits = (abs(left).bit_length() - 1) * right  # at most the result's bits
        if bits > MAX_INT_BITS:
            raise _too_big(f"{expr()}: more than {MAX_INT_BITS:,} bits")
    elif operator == "*" and ints:
        if left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
            raise _too_big(f"{expr()}: more than {MAX_INT_BITS:,} bits")
    elif operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                    and len(seq) * n > MAX_CHARS:
                raise _too_big(f"{expr()}: {len(seq) * n:,} items, more than {MAX_CHARS:,}")
    elif operator == "+" and isinstance(left, (str, list, tuple)) \
            and isinstance(right, (str, list, tuple)) and len(left) + len(right) > MAX_CHARS:
        raise _too_big(f"{expr()}: {len(left) + len(right):,} items, more than {MAX_CHARS:,}")


def _bounded_range(*args: int) -> range:
    """range(), refused past MAX_RANGE items (Jinja's sandbox raises a bare OverflowError)."""
    r = range(*args)
    try:
        n = len(r)
    except OverflowError:  # longer than sys.maxsize
        n = None
    if n is None or n > MAX_RANGE:
        shown = ", ".join(_show(a) for a in args)
        raise ChatTemplateLimitExceeded(f"the chat template asked for range({shown}): more "
                                        f"than {MAX_RANGE:,} items")
    return r


class _Counted:
    """An iterable whose every item costs one step of the render's budget; its len() is the
    wrapped one's, so that `loop.length` does not read it all ahead."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # TypeError: LoopContext copes

    def __iter__(self) -> Iterator[Any]:
        for item in self._iterable:
            _step()
            yield item


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler, with every `for` loop's iterable counted and every `~` checked."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        # nested loops are how a short template runs for ever: count each iteration
        iterable = node.iter
        if not (isinstance(iterable, nodes.Call)
                and isinstance(iterable.node, nodes.EnvironmentAttribute)):
            node.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [iterable], [], None,
                                   None, lineno=node.lineno)
        super().visit_For(node, frame)

    def _output_child_to_const(self, node: nodes.Expr, frame: Frame, finalize: Any) -> str:
        # Jinja computes a `{{ }}` whose value is constant while it compiles, outside every
        # bound: `{{ '%*s' % (3*10**8, 'x') }}` took 2.3 GB at load. Only literal text is
        # folded; the rest is computed, and bounded, when the template renders.
        if not isinstance(node, (nodes.TemplateData, nodes.Const)):
            raise nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # `a ~ b` joins with jinja2.runtime's str_join, not environment.concat
        self.write("environment.bounded_text(")
        super().visit_Concat(node, frame)
        self.write(")")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with the render's budget charged on loops and calls, and the size checked
    of what `*`, `**`, `+`, `~` and the output build."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+"})

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any
             ) -> Any:
        _step()
        if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive loop
            args = (_Counted(args[0]), *args[1:])
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """"".join, stopped past MAX_CHARS: the output, a macro's text, a {% set %} block's."""
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > MAX_CHARS:
                raise ChatTemplateLimitExceeded(f"the chat template's text grows past "
                                                f"{MAX_CHARS:,} characters")
            out.append(piece)
        return "".join(out)

    def counted(self, iterable: Iterable[Any]) -> _Counted:
        return _Counted(iterable)

    def bounded_text(self, text: str) -> str:
        return _check_size(text, "a string (with ~)")


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


def _environment() -> _BoundedEnvironment:
    # optimized=False: Jinja's optimizer folds constant expressions (`{% set %}`, `{% if %}`)
    # while it compiles, outside every bound; unfolded, they are computed when rendered
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, optimized=False,
                              extensions=[_GenerationTag, loopcontrols])
    env.globals["range"] = _bounded_range
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
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:  # deep nesting, ...
            raise TokenizerError(f"chat template does not compile: {_describe(e)}") from e

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
        budget = _budget.set(_Budget(MAX_STEPS, time.monotonic() + RENDER_TIMEOUT_S))
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except ChatTemplateLimitExceeded:
            raise
        except _RENDER_FAILURES as e:
            raise TokenizerError(f"chat template failed to render: {_describe(e)}") from e
        finally:
            _budget.reset(budget)


def _describe(e: BaseException) -> str:
    """Jinja's errors say what they are; Python's (ZeroDivisionError, ...) need their name."""
    return str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
