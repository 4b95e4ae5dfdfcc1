"""The chat page against a server started with --api-key, in a real browser (the system's
Chromium through Selenium, as test_chat_page_browser.py; it skips the same way without one):
the page loads and shows the model without the key (/health is open), a message gets the
server's 401 as an error that asks for the key and shows the key field, and with the key typed
in the reply streams to its end."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from test_chat_page_browser import _replies, _send, _state, _wait, browser  # noqa: E402,F401

# a server process and a browser: seconds
pytestmark = pytest.mark.slow

KEY = "sk-page-7e21"


@pytest.fixture(scope="module")
def keyed_server(browser, tmp_path_factory):  # noqa: F811  (the imported fixture)
    from server_process import ServerProcess

    from slipstream.synth import write_synth

    path = write_synth(tmp_path_factory.mktemp("page-key") / "tiny.gguf", "tiny", "Q8_0",
                       n_layers=2, seed=3)
    proc = ServerProcess("-m", str(path), "--ctx", "256", "--api-key", KEY)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_chat_page_asks_for_the_key_then_streams(keyed_server, browser):  # noqa: F811
    browser.get(keyed_server.url + "/")
    _wait(browser, lambda d: "ctx" in d.find_element("id", "model").text, 30,
          "the page to show the served model")
    key_field = browser.find_element("id", "api-key")
    assert not key_field.is_displayed()  # nothing asks for a key before the server does

    _send(browser, "Hello there.", 8)
    _wait(browser, lambda d: d.find_elements("css selector", ".msg.error") and
          _state(d) == "idle", 60, "the server's 401 to show")
    error = browser.find_element("css selector", ".msg.error").text
    assert "API key" in error, error
    assert key_field.is_displayed()
    assert not _replies(browser)  # the failed question left no reply behind

    key_field.send_keys(KEY)
    _send(browser, "Hello again.", 8)
    _wait(browser, lambda d: len(_replies(d)) == 1 and _state(d) == "idle", 60,
          "the reply to finish")
    stats = browser.find_element("id", "stats").text
    assert re.search(r"finish: (length|stop)", stats), stats
    assert len(browser.find_elements("css selector", ".msg.error")) == 1  # no new error
    metrics = httpx.get(keyed_server.url + "/metrics", timeout=30,
                        headers={"Authorization": f"Bearer {KEY}"}).text
    # the one refused chat request, then the one answered
    assert 'slipstream_requests_total{endpoint="/v1/chat/completions",status="401"} 1.0' in \
        metrics
    assert 'slipstream_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in \
        metrics
