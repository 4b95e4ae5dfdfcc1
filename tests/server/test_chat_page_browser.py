"""The chat page at / in a real browser: the system's Chromium (Debian's `chromium` and
`chromium-driver` packages), driven by Selenium, against a real `slipstream serve` process.

It sends a message and watches streamed text arrive, shows tok/s, stops a reply (the server
sees the cancellation) and carries on the conversation. Without Chromium the browser tests
skip, saying so; CI installs it.
"""

from __future__ import annotations

import re
import shutil
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from slipstream.server.app import create_app  # noqa: E402

STATS = re.compile(r"(\d+) tok · ([\d.]+|–) tok/s")
LONG_REPLY_TOKENS = 400  # far more than the test waits for: the reply must still be running


def test_root_serves_the_chat_page_while_the_model_loads():
    """GET / answers at once, before any model is attached (no browser needed)."""
    with TestClient(create_app(None)) as client:
        r = client.get("/")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        page = r.text
        # it streams from our own endpoint and can abort the fetch
        assert "/v1/chat/completions" in page and "stream: true" in page
        assert "AbortController" in page and "tok/s" in page
        assert client.get("/health").status_code == 503  # while the page is already there


# --- the browser -------------------------------------------------------------------------------

def _chromium() -> tuple[str, str] | None:
    """(browser, driver) paths of the system's Chromium, or None."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                  "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    paths = _chromium()
    if paths is None:
        pytest.skip("no Chromium with chromedriver installed (apt-get install -y chromium "
                    "chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900"):
        opts.add_argument(arg)
    # the driver's path given explicitly: Selenium Manager would otherwise try to download one
    driver = webdriver.Chrome(options=opts,
                              service=webdriver.ChromeService(executable_path=paths[1]))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def server(browser):  # after the browser: no model is loaded for nothing when it skips
    from server_process import ServerProcess

    proc = ServerProcess()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _wait(driver, until, timeout: float, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: until(d), message=f"timed out after {timeout} s waiting for {what}")


def _replies(driver) -> list[str]:
    return [e.text for e in driver.find_elements("css selector", ".msg.assistant")]


def _state(driver) -> str:
    return driver.find_element("tag name", "body").get_attribute("data-state")


def _send(driver, text: str, max_tokens: int) -> None:
    box = driver.find_element("id", "max-tokens")
    box.clear()
    box.send_keys(str(max_tokens))
    temp = driver.find_element("id", "temperature")
    temp.clear()
    temp.send_keys("0")
    driver.find_element("id", "input").send_keys(text)
    driver.find_element("id", "send").click()


def test_chat_page_streams_shows_rate_and_stops(server, browser):
    browser.get(server.url + "/")
    _wait(browser, lambda d: "ctx" in d.find_element("id", "model").text, 30,
          "the page to show the served model")
    assert "SmolLM2" in browser.find_element("id", "model").text
    assert browser.find_element("id", "stop").get_attribute("disabled") is not None
    cancelled_before = server.metric("slipstream_cancelled_total", 'stage="running"')

    _send(browser, "Write a long story about a dragon who learns to bake bread.",
          LONG_REPLY_TOKENS)
    # streamed: the reply is seen with some text, and then with more, while still streaming
    first = _wait(browser, lambda d: (_replies(d) or [""])[-1].strip() or False, 120,
                  "the first streamed text")
    _wait(browser, lambda d: len(_replies(d)[-1].strip()) > len(first) + 10, 120,
          "the reply to grow")
    assert _state(browser) == "streaming"
    stop = browser.find_element("id", "stop")
    assert stop.get_attribute("disabled") is None
    m = STATS.search(browser.find_element("id", "stats").text)
    assert m and int(m.group(1)) >= 2 and float(m.group(2)) > 0, \
        browser.find_element("id", "stats").text

    stop.click()
    _wait(browser, lambda d: _state(d) == "idle", 30, "the page to leave the streaming state")
    stats = browser.find_element("id", "stats").text
    assert "stopped" in stats, stats
    m = STATS.search(stats)
    assert m and 2 <= int(m.group(1)) < LONG_REPLY_TOKENS, stats  # it stopped early
    stopped_text = _replies(browser)[-1]
    # the server cancelled the generation (the browser closed the connection) ...
    deadline = time.monotonic() + 15
    while server.metric("slipstream_cancelled_total", 'stage="running"') <= cancelled_before:
        assert time.monotonic() < deadline, "the server never saw the reply cancelled"
        time.sleep(0.2)
    # ... and nothing more arrives on the page
    time.sleep(1.0)
    assert _replies(browser)[-1] == stopped_text
    assert browser.find_element("id", "send").get_attribute("disabled") is None

    # the conversation carries on after a stop: a short reply runs to its end
    _send(browser, "Thank you. Now say hello.", 8)
    _wait(browser, lambda d: len(_replies(d)) == 2 and _state(d) == "idle", 120,
          "the second reply to finish")
    stats = browser.find_element("id", "stats").text
    assert re.search(r"finish: (length|stop)", stats), stats
    assert _replies(browser)[1].strip()
    assert len(browser.find_elements("css selector", ".msg.user")) == 2
    assert not browser.find_elements("css selector", ".msg.error")
