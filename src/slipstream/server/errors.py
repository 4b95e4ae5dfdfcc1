"""OpenAI-style API errors: `{"error": {"message", "type", "param", "code"}}` with a status code.

Every error the server answers on purpose goes through `APIError`, so clients written against
OpenAI (the `openai` package raises `BadRequestError`, `NotFoundError`, ... from the status and
reads the body) see the shapes they expect.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..errors import BadArgument, ContextOverflow, SlipstreamError
from ..memory.disk import FileChanged
from .templates import RenderWorkerError

INVALID = "invalid_request_error"


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = INVALID,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message may quote what the client sent,
    and a lone surrogate in it would make Starlette's UTF-8 rendering fail (a 500 instead of
    the error being reported)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_slipstream(e: SlipstreamError) -> APIError:
    """Map an engine error raised while preparing or running a request."""
    if isinstance(e, ContextOverflow):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, BadArgument):
        return APIError(400, str(e))
    if isinstance(e, FileChanged):  # every later request fails too, until a restart
        return APIError(500, str(e), type="server_error", code="model_file_changed")
    return APIError(500, str(e), type="server_error", code="internal_error")


class TemplateFault(APIError):
    """The served model's chat template failed on a request, and it cannot render a typical
    conversation either (checked at start): the model file is at fault, not the client."""

    def __init__(self, model_file: str, reason: str, problem: str):
        there = "" if problem in reason else f" ({problem})"
        super().__init__(
            500, f"the served model's chat template (tokenizer.chat_template in {model_file}) "
            f"failed: {reason}. It fails on a typical conversation too{there}, checked at "
            f"start: the model's template is at fault, not the request. Start the server with "
            f"--template-fallback to serve ChatML instead.",
            type="server_error", code="chat_template_error")


def from_template_failure(e: SlipstreamError, model_file: str, problem: str | None
                          ) -> APIError:
    """Map a failed chat-template render: the server's fault when no worker could render or
    the template fails a typical conversation too (`problem`, from the check at start), else
    the conversation's (a role the template refuses with raise_exception, ...)."""
    if isinstance(e, RenderWorkerError):
        return APIError(500, str(e), type="server_error", code="template_worker_failed")
    if problem is not None:
        return TemplateFault(model_file, str(e), problem)
    return bad_request(f"the prompt could not be prepared: {e}", param="messages")


def from_validation(exc: RequestValidationError) -> APIError:
    """Turn FastAPI's 422 (pydantic errors or a body that is not JSON) into OpenAI's 400."""
    errors = exc.errors()
    if not errors:
        return bad_request("the request body is invalid")
    # Our own checks (value errors) say most: in a union ("prompt": str | list[str]) the
    # branch that fails on a bad string is listed after the branch that wanted another type.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON ({detail})".replace(" ()", ""))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union branches add their type name to the location ("stop.str"); keep the field path.
    loc = [p for p in loc if p not in _UNION_TAGS and "[" not in p]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if param is None and isinstance(first.get("input"), (bytes, str)):
        # FastAPI parses JSON only for a JSON (or absent) Content-Type; curl -d sends a form type
        msg = "the request body must be JSON, sent with Content-Type: application/json"
    elif param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
    elif param is not None and first.get("type") != "value_error":
        # value errors are ours and name what is wrong; pydantic's own need the field and input
        msg = f"{param}: {msg}"
        if "input" in first and first.get("type") != "missing":
            msg += f" (got {_short(first['input'])})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return bad_request(msg, param=param)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "list[str]", "list[int]",
               "list[list[int]]", "none", "function-after", "function-before", "literal"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
