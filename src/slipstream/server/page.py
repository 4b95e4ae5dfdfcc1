"""GET / : the chat page (static/chat.html), as llama-server serves one.

The page is one static file with no build step; it talks to this server only through its
OpenAI endpoints (streamed /v1/chat/completions), so it needs nothing from the app but a route.
It is read from the package once, at the first request, and kept: it never changes while the
server runs.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@lru_cache(maxsize=1)
def chat_html() -> str:
    """The page's text, from the installed package (a wheel ships it as package data)."""
    return resources.files("slipstream.server").joinpath("static/chat.html").read_text("utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(chat_html())
