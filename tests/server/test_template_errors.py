"""Whose fault a failed chat-template render is, through the app on a fake model whose chat
template is real (rendered by the worker pool): the client's (400) when the template renders a
typical conversation, the server's (500, or ChatML with template_fallback) when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from slipstream.modelfile.chat_template import CHATML_TEMPLATE, ChatTemplate  # noqa: E402
from slipstream.runtime.generate import Generation, GenerationEvent, GenerationStats  # noqa: E402
from slipstream.server import create_app  # noqa: E402

REFUSES_TOOL = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                "{{ raise_exception('tool messages are not supported') }}{% endif %}"
                "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
BROKEN = "{{ messages[0]['content'] + 1 }}"  # str + int: no conversation renders


class TemplatedModel:
    """A fake model (no weights) with a real chat template; its prompt ids are the
    characters of the rendered text, so a test can tell which template rendered."""

    path = Path("templated.gguf")
    ctx = 4096
    device = "cpu"

    class tokenizer:
        vocab_size = 0x110000

    def __init__(self, source: str):
        self.template = ChatTemplate(source)
        self.prompts: list[list[int]] = []

    def prompt_ids(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def generate(self, ids, max_tokens=16, **kw):
        self.prompts.append(list(ids))
        stats = GenerationStats(prompt_tokens=len(ids), generated_tokens=1)
        return Generation(iter([GenerationEvent(0, "ok", 0, "stop")]), stats)


def chat(client: TestClient, *messages: dict) -> object:
    return client.post("/v1/chat/completions", json={"messages": list(messages),
                                                     "max_tokens": 1})


USER = {"role": "user", "content": "hi"}


def test_a_conversation_the_template_refuses_is_the_clients_400(capsys):
    model = TemplatedModel(REFUSES_TOOL)
    with TestClient(create_app(model)) as c:
        r = chat(c, USER)
        assert r.status_code == 200, r.text
        assert "".join(map(chr, model.prompts[0])) == "[user] hi\n"
        r = chat(c, USER, {"role": "tool", "content": "42"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "messages"
        assert "tool messages are not supported" in err["message"]
    assert "chat template" not in capsys.readouterr().err  # nothing reported at start


def test_a_broken_template_is_reported_once_and_its_chats_are_500s(capsys):
    with TestClient(create_app(TemplatedModel(BROKEN))) as c:
        r = chat(c, USER)
        assert r.status_code == 500 and r.json()["error"]["code"] == "chat_template_error"
        assert "tokenizer.chat_template in templated.gguf" in r.json()["error"]["message"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "templated.gguf cannot render a typical conversation" in lines[0]


def test_template_fallback_serves_chatml_for_a_broken_template(capsys):
    model = TemplatedModel(BROKEN)
    with TestClient(create_app(model, template_fallback=True)) as c:
        r = chat(c, USER)
        assert r.status_code == 200, r.text
        expected = ChatTemplate(CHATML_TEMPLATE).render([USER])
        assert "".join(map(chr, model.prompts[0])) == expected
    assert "serving ChatML instead (--template-fallback)" in capsys.readouterr().err
