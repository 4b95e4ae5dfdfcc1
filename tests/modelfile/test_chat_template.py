"""Chat templates rendered by slipstream against Hugging Face's `apply_chat_template`."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import gguf
import pytest

from slipstream.modelfile import chat_template
from slipstream.modelfile.chat_template import CHATML_TEMPLATE, ChatTemplate
from slipstream.errors import ChatTemplateLimitExceeded, TokenizerError
from slipstream.modelfile.tokenizer import read_tokenizer_metadata

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi!"}],
    "multi-turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Answer with <b>bold</b> & ünïcödé 😀"},
    ],
    "system": [SYSTEM, {"role": "user", "content": "Hi!"}],
    "system multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi.\nHow can I help?"},
        {"role": "user", "content": "  spaces and\ttabs  "},
    ],
}

# Exercises what HF's environment adds over plain Jinja: trim_blocks/lstrip_blocks (indented
# block tags on their own lines), loop controls, namespace, tojson without HTML escaping,
# `{% generation %}`, and the special-token variables.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% if tools %}
    Tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'skip' %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if message['role'] == 'assistant' %}
        {% generation %}[A{{ ns.n }}] {{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
    {% else %}
        [{{ message['role'] | upper }}{{ ns.n }}] {{ message['content'] }}
    {% endif %}
    {% if loop.index > 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[A]{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find <x> & \"y\" in café",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def smol_md(smollm_path: Path) -> dict:
    return read_tokenizer_metadata(gguf.GGUFReader(str(smollm_path)))


@pytest.fixture(scope="module")
def smol_hf(smollm_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_model_template_matches_hf(smol_md, smol_hf, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    ours = ChatTemplate.from_metadata(smol_md).render(messages, add_generation_prompt=add_generation_prompt)
    hf = smol_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == hf
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_model_template_is_the_files(smol_md) -> None:
    template = ChatTemplate.from_metadata(smol_md)
    assert not template.is_fallback
    assert template.source == smol_md["tokenizer.chat_template"]
    # The SmolLM template inserts its default system prompt when there is none.
    assert "named SmolLM" in template.render(CONVERSATIONS["single"])
    assert "named SmolLM" not in template.render(CONVERSATIONS["system"])


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_rich_template_matches_hf(smol_md, smol_hf, name: str) -> None:
    messages = CONVERSATIONS[name] + [{"role": "skip", "content": "not shown"}]
    tokens = ChatTemplate.from_metadata(smol_md).special_tokens
    ours = ChatTemplate(RICH_TEMPLATE, bos_token=tokens["bos_token"], eos_token=tokens["eos_token"])
    for tools in (None, TOOLS):
        want = smol_hf.apply_chat_template(messages, tools=tools, chat_template=RICH_TEMPLATE,
                                           tokenize=False, add_generation_prompt=True)
        assert ours.render(messages, tools=tools) == want
    assert '"Find <x> & \\"y\\" in café"' in ours.render(messages, tools=TOOLS)


def test_fallback_is_chatml_when_the_file_has_no_template(smol_md) -> None:
    md = {k: v for k, v in smol_md.items() if k != "tokenizer.chat_template"}
    template = ChatTemplate.from_metadata(md)
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    rendered = template.render(CONVERSATIONS["system"])
    assert rendered == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(CONVERSATIONS["single"], add_generation_prompt=False) == \
        "<|im_start|>user\nHi!<|im_end|>\n"
    assert ChatTemplate.from_metadata({}).is_fallback


def test_special_token_strings_come_from_the_vocabulary(smol_md) -> None:
    tokens = ChatTemplate.from_metadata(smol_md).special_tokens
    assert tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                      "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}


def test_strftime_now_and_extra_variables() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') | length }} {{ enable_thinking }}")
    assert template.render([], enable_thinking=False) == "4 False"


def test_template_errors_raise_tokenizer_error() -> None:
    with pytest.raises(TokenizerError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    raising = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                           "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}ok")
    assert raising.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="must start with a user turn"):
        raising.render([{"role": "assistant", "content": "x"}])
    # The sandbox is immutable: a template cannot change the caller's messages.
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TokenizerError):
        ChatTemplate("{{ messages.append(1) }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]
    with pytest.raises(TokenizerError):
        ChatTemplate("{{ messages[0].__class__.__subclasses__() }}").render(messages)


def _render_within(source: str, seconds: float = 30.0) -> BaseException | str:
    """Compile and render `source` on a thread; what it returned or raised. Fails the test if
    it still runs after `seconds` (an unbounded template: the thread is left to the process)."""
    result: list[BaseException | str] = []

    def run() -> None:
        try:
            result.append(ChatTemplate(source).render([{"role": "user", "content": "hi"}]))
        except BaseException as e:  # noqa: BLE001 - the test looks at what it was
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still rendering after {seconds} s: {source}"
    assert time.monotonic() - t0 < seconds
    return result[0]


# (template, what the error names). Unbounded, the first would hang or refuse with an error
# of another type; the second would build gigabytes (or a 1 TB string, or a 10**7-digit
# number): kept small enough here for a run without the bounds to fail, not to fill the RAM.
LOOPING = {
    "huge range": ("{% for i in range(10**12) %}x{% endfor %}", r"range\(1000000000000\)"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}", "more than 250,000 loop iterations and calls"),
    "nested loops over a string": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}"
                                   "{% endfor %}{% endfor %}", "loop iterations"),
    "exponential macro": ("{% macro d(n) %}{% if n > 0 %}{{ d(n - 1) }}{{ d(n - 1) }}{% endif %}"
                          "{% endmacro %}{{ d(60) }}", "loop iterations and calls"),
}
EXPLODING = {
    "repeated string": ("{{ 'x' * 10**12 }}", r"'x' \* 1000000000000: 1,000,000,000,000 items"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
               "text grows past 16,777,216 characters"),
    "doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(26) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                        "a string \\(with ~\\) of 33,554,432 items"),
    "doubling with +": ("{% set ns = namespace(s=['x']) %}{% for i in range(26) %}"
                        "{% set ns.s = ns.s + ns.s %}{% endfor %}", "33,554,432 items"),
    "doubling through a macro": ("{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}"
                                 "{% set ns = namespace(s='x') %}{% for i in range(26) %}"
                                 "{% set ns.s = d(ns.s) %}{% endfor %}", "text grows past"),
    "power": ("{{ 10 ** 10000000 }}", r"10 \*\* 10000000: more than 65,536 bits"),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(24) %}"
                 "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}", "65,536 bits"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "exponential macro" else n for n in LOOPING])
def test_a_looping_template_is_stopped(name: str) -> None:
    source, names = LOOPING[name]
    error = _render_within(source)
    assert isinstance(error, ChatTemplateLimitExceeded), repr(error)[:300]
    assert isinstance(error, TokenizerError)  # the server answers it with a 400
    assert error.args[0].startswith("the chat template ")
    # the named bound, or the 5 s one where a loaded machine renders too slowly to reach it
    # first (on CI's 2 cores the exponential macro's 250,000 calls took over 5 s)
    assert re.search(f"{names}|ran for more than 5 s", str(error)), str(error)


@pytest.mark.parametrize("name", EXPLODING)
def test_an_exploding_template_is_stopped(name: str) -> None:
    source, names = EXPLODING[name]
    error = _render_within(source)
    assert isinstance(error, ChatTemplateLimitExceeded), repr(error)[:300]
    assert re.search(names, str(error)), str(error)


def test_a_slow_template_is_stopped_by_the_clock(monkeypatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", -1.0)
    with pytest.raises(ChatTemplateLimitExceeded, match="ran for more than -1 s"):
        ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").render(
            [{"role": "user", "content": "hi"}])


def test_python_errors_in_a_template_raise_tokenizer_error() -> None:
    for source, names in [("{{ 1 / 0 }}", "ZeroDivisionError"),
                          ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
                          ("{{ 'a' + 1 }}", "TypeError")]:
        error = _render_within(source)
        assert type(error) is TokenizerError and names in str(error), repr(error)[:300]


def test_bounded_templates_render_as_before() -> None:
    """The bounds leave what real templates do alone: loop.length and loop.last, recursive
    loops, range(), small repetitions, ~ and +."""
    source = ("{% for m in messages %}{{ m.content }}{{ loop.index }}/{{ loop.length }}"
              "{{ '.' if loop.last else ',' }}{% endfor %}"
              "{% for x in tree recursive %}[{{ x.n }}{{ loop(x.kids) if x.kids }}]{% endfor %}"
              "{{ range(3) | list }}{{ '-' * 3 }}{{ 'a' ~ 'b' + 'c' }}{{ 2 ** 10 }}")
    tree = [{"n": 1, "kids": [{"n": 2, "kids": []}]}, {"n": 3, "kids": []}]
    out = ChatTemplate(source).render([{"role": "user", "content": "a"},
                                       {"role": "user", "content": "b"}], tree=tree)
    assert out == "a1/2,b2/2.[1[2]][3][0, 1, 2]---abc1024"
