"""Request bodies of the OpenAI endpoints, validated with pydantic.

Numbers are strict (`"0.5"` is not a temperature, `true` is not a max_tokens), as OpenAI's API
is. Unknown fields are ignored, so clients that send `user`, `store`, `metadata`,
`parallel_tool_calls` and the like keep working; fields whose meaning we cannot honour
(`n > 1`, `logprobs: true`, `tools`, `echo`, ...) are rejected with a 400 rather than silently
dropped.

Sampling defaults when a field is absent are slipstream's (temperature 0.8, top_p 0.95,
top_k 40, min_p 0.05), like llama.cpp's server, not OpenAI's (temperature 1, top_p 1).
`top_k`, `min_p` and `repeat_penalty` are accepted as extensions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, \
    StrictStr, ValidationInfo, field_validator, model_validator

MAX_STOPS = 4  # OpenAI's limit


def _unicode_text(v: str) -> str:
    """JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate ("\\ud800"), which Python's
    json accepts as a str that no UTF-8 encoder (the tokenizer's, the response's) can take:
    refuse it here, where the error can still name the field, instead of failing later."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text is not valid Unicode: {v[e.start]!a} at character "
                         f"{e.start} is a lone UTF-16 surrogate") from None
    return v


# Every string the server reads from a request: strict (no coercion) and valid Unicode.
Text = Annotated[StrictStr, AfterValidator(_unicode_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: Text | None = None  # optional here: a single-model server knows what to run
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)  # torch's seed range
    stop: Text | list[Text] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"n={v} is not supported: slipstream returns one choice per "
                             f"request; use n=1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def sampling_kwargs(self, default_max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for Model.generate."""
        kw: dict[str, Any] = {"max_tokens": self.max_tokens or default_max_tokens}
        for name in ("temperature", "top_k", "min_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty", "seed", "stop"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.top_p is not None:
            # OpenAI allows top_p 0 (keep only the most likely token); the sampler needs > 0,
            # and any tiny positive value keeps exactly the top token.
            kw["top_p"] = self.top_p if self.top_p > 0 else 1e-9
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: Text | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        # a batch of prompts would be several choices; only a batch of one is allowed
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"a list of {len(v)} prompts is not supported; send one "
                                 f"prompt per request")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo", "best_of", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        allowed = (None, 1) if info.field_name == "best_of" else (None, False, "")
        if v not in allowed:
            raise ValueError(f"{info.field_name}={v!r} is not supported")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text content, `developer` as `system`."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise ValueError(f"content part type {bad[0]!r} is not supported (text only)")
            content = "".join(p.text or "" for p in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name:
            msg["name"] = self.name
        return msg


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _text_only(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(v):
            try:
                m.for_template()
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}") from None
        return v

    @field_validator("logprobs", "tools")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v: dict | None) -> dict | None:
        if v and v.get("type", "text") != "text":
            raise ValueError(f"type {v.get('type')!r} is not supported (text only)")
        return v

    @model_validator(mode="after")
    def _newer_name_wins(self) -> ChatRequest:
        # max_completion_tokens replaces max_tokens in OpenAI's chat API
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self
