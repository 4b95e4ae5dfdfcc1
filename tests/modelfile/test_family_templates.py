"""The chat templates of the model families, rendered by slipstream and by transformers.

tests/data/chat-templates/ holds each family's real template (README.md there says where each
comes from). transformers' `render_jinja_template` (what `apply_chat_template` calls) is the
reference: the same messages, generation prompt, special tokens and keyword arguments
(`enable_thinking`, `tools`) must give the same string, character for character.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2
import pytest

from slipstream.errors import TokenizerError
from slipstream.modelfile.chat_template import ChatTemplate

render_jinja_template = pytest.importorskip(
    "transformers.utils.chat_template_utils").render_jinja_template

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat-templates"

# The special tokens each family's tokenizer_config.json names (what HF passes the template).
SPECIALS: dict[str, dict[str, str | None]] = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "gemma4": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "phi4": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|dummy_85|>"},
    "mistral3": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
    "glm4": {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "cohere2": {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>",
                "pad_token": "<PAD>"},
    "olmo2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
}

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
THOUGHT = "<think>\nThe user greets; greet back.\n</think>\n\nHello! How can I help?"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# name -> (messages, keyword arguments); every family renders every one of them.
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "user": ([{"role": "user", "content": "Hi there"}], {}),
    "system": ([SYSTEM, {"role": "user", "content": "  What is 2+2?  "}], {}),
    "history": ([SYSTEM, {"role": "user", "content": "Hello"},
                 {"role": "assistant", "content": THOUGHT},
                 {"role": "user", "content": "And in French?"}], {}),
    "no-thinking": ([{"role": "user", "content": "Quick: capital of France?"}],
                    {"enable_thinking": False}),
    "thinking": ([{"role": "user", "content": "Prove it."}], {"enable_thinking": True}),
    "tools": ([SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
              {"tools": [WEATHER_TOOL]}),
    # Gemma 3's template refuses two user turns in a row (raise_exception): both must refuse.
    "two-users": ([{"role": "user", "content": "One"}, {"role": "user", "content": "Two"}], {}),
}


def _reference(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
               specials: dict[str, str | None], kwargs: dict[str, Any]) -> str:
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    # HF passes the special tokens the tokenizer has (its special_tokens_map), none for a
    # missing one; slipstream passes "" for it. Both print as nothing.
    present = {name: value for name, value in specials.items() if value is not None}
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                        chat_template=source,
                                        add_generation_prompt=add_generation_prompt,
                                        **present, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", sorted(SPECIALS))
def test_renders_as_transformers(family: str, conversation: str,
                                 add_generation_prompt: bool) -> None:
    source = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    specials = SPECIALS[family]
    messages, kwargs = CONVERSATIONS[conversation]
    template = ChatTemplate(source, bos_token=specials["bos_token"] or "",
                            eos_token=specials["eos_token"] or "",
                            pad_token=specials["pad_token"])
    try:
        want = _reference(source, messages, add_generation_prompt, specials, kwargs)
    except jinja2.TemplateError as e:  # the template refuses these messages (raise_exception)
        with pytest.raises(TokenizerError, match=re.escape(str(e))):
            template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return
    got = template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert got == want


def _render(family: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    specials = SPECIALS[family]
    return ChatTemplate((TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8"),
                        bos_token=specials["bos_token"] or "",
                        eos_token=specials["eos_token"] or "").render(messages, **kwargs)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_system_message_handling(family: str) -> None:
    # The comparison above holds whatever the template does; this says what it does. Gemma 3
    # has no system turn: the system text opens the first user turn. Gemma 4 has one.
    messages, _ = CONVERSATIONS["system"]
    text = _render(family, messages)
    if family == "gemma3":
        assert "<start_of_turn>system" not in text
        assert text == ("<bos><start_of_turn>user\nYou are terse. Answer in one line.\n\n"
                        "What is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    else:
        assert "You are terse. Answer in one line." in text
        assert text.index("You are terse") < text.index("What is 2+2?")


def test_qwen3_thinking_tags() -> None:
    user = [{"role": "user", "content": "Quick: capital of France?"}]
    # enable_thinking=False opens the reply with an empty think block; by default it is open.
    assert _render("qwen3", user, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render("qwen3", user).endswith("<|im_start|>assistant\n")
    # A past assistant turn keeps only its answer: the reasoning is dropped from history.
    messages, _ = CONVERSATIONS["history"]
    text = _render("qwen3", messages)
    assert "The user greets" not in text
    assert "<|im_start|>assistant\nHello! How can I help?<|im_end|>" in text


def _llama_cpp_builtin(source: str, messages: list[dict[str, Any]]) -> str:
    """llama.cpp's rendering of `messages` in the built-in format it detects from `source`
    (`llama_chat_apply_template`; it adds no BOS, which its tokenizer adds)."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    chat = (llama_cpp.llama_chat_message * len(messages))()
    encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]
    for slot, (role, content) in zip(chat, encoded):
        slot.role, slot.content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(source.encode(), chat, len(messages), True, buf,
                                            len(buf))
    assert 0 < n <= len(buf), "llama.cpp does not recognise the template"
    return buf.raw[:n].decode()


@pytest.mark.parametrize("conversation", ["user", "system", "history"])
@pytest.mark.parametrize("family", ["gemma3", "phi4"])
def test_renders_as_llama_cpp_builtin(family: str, conversation: str) -> None:
    # llama.cpp has these two formats built in (Gemma's with the system text folded into the
    # first user turn, whitespace trimmed); its renders must be ours less the BOS text. Its
    # built-in Qwen, Mistral, GLM, Cohere and OLMo formats are approximations that drop
    # features of the real templates (thinking blocks, default system prompts), so only
    # transformers is the reference for those.
    messages, _ = CONVERSATIONS[conversation]
    source = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    ours = _render(family, messages, add_generation_prompt=True)
    bos = SPECIALS[family]["bos_token"] or ""
    assert ours.removeprefix(bos) == _llama_cpp_builtin(source, messages)
