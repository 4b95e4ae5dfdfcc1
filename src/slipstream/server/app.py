"""The FastAPI app: OpenAI-compatible endpoints over one shared Model.

    app = create_app(slipstream.load(), max_queue=16)

Requests are validated and tokenized on the event loop's side (tokenizing runs on a one-thread
executor so a long prompt does not stall other clients), then queued for the single generation
thread (see worker.py). The handlers only await what that thread produces. Chat templates
render in worker processes under memory and time limits (templates.py), beside generation and
beside each other; a template that cannot render a typical conversation is the model's fault,
so its failures are 500s (`chat_template_error`), not 400s.

An app can also start before its model: create_app(None) answers /health with 503
`{"status": "loading"}` and the other endpoints with 503 (code "model_loading") until
`app.state.attach(model)`; `slipstream serve` listens first and loads the model meanwhile.

Model names accepted: the GGUF file stem (what /v1/models lists), the file name, and the alias
"default"; a request without `model` gets the served model too.

A request without max_tokens generates at most `max_tokens_default` tokens (512 unless the
server says otherwise; /v1/completions keeps OpenAI's 16 where that is fewer); one asking for
more tokens than the context holds is refused with a 400.

Hostile input gets a 4xx, never a 5xx: a body over `max_body` bytes a 413 before it is read
(limits.py), text that is not valid Unicode (a lone surrogate spelled as a JSON escape) a 400
naming the field (schemas.py). A client that goes away cancels its job, between two prefill
chunks of a long prompt too (worker.py).

Admission (access.py): with `allowed_hosts`, a request whose Host header names none of them gets
a 400 (DNS rebinding); with `api_key`, every endpoint but /health and the chat page wants
`Authorization: Bearer <key>` (401 otherwise).

Shutdown: `app.state.end_requests()` (safe from any thread; run.py calls it when the grace
period after SIGTERM is over) ends every open request at once: a stream with an error event
(code "server_shutting_down") and `data: [DONE]`, a non-streamed request with a 503, and so
does any request that arrives after it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import SimpleNamespace

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SlipstreamError
from ..modelfile.chat_template import ChatTemplate
from ..runtime.generate import GenerationEvent
from .access import ApiKeyMiddleware, HostCheckMiddleware
from .errors import APIError, bad_request, from_slipstream, from_template_failure, \
    from_validation
from .limits import DEFAULT_MAX_BODY, BodyLimitMiddleware, BodyTooLarge
from .metrics import Metrics, MetricsMiddleware
from .openai_format import DONE_LINE, Formatter, sse
from .page import router as chat_page
from .schemas import ChatRequest, CompletionRequest
from .templates import ServedTemplate
from .worker import Done, GenerationWorker, Job, QueueFull

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_TOKENS = 512  # a request without max_tokens: a reply, not the whole context
ALIASES = ("default",)
LOADING_RETRY_AFTER_S = 5


def default_max_tokens(max_tokens_default: int, ctx: int) -> tuple[int, int]:
    """(chat, completions): what a request without max_tokens gets on a model of `ctx`
    tokens; max_tokens_default -1 means until the context is full."""
    chat = ctx if max_tokens_default == -1 else min(max_tokens_default, ctx)
    return chat, min(COMPLETION_DEFAULT_MAX_TOKENS, chat)


def create_app(model=None, max_queue: int = 16, model_id: str | None = None,
               spec_nodes: int | None = None, spec_depth: int | None = None,
               max_tokens_default: int = DEFAULT_MAX_TOKENS,
               max_body: int = DEFAULT_MAX_BODY, template_fallback: bool = False,
               api_key: str | None = None,
               allowed_hosts: Sequence[str] | None = None) -> FastAPI:
    """A model loaded with a draft (load(draft=...)) decodes every request speculatively;
    spec_nodes and spec_depth fix its trees' size (None: Model.generate sizes them).
    model None: the app answers "loading" until app.state.attach(model). max_body: request
    bodies over this many bytes get a 413 before they are read (limits.py). The model's chat
    template renders in worker processes (templates.py), checked once when it is attached;
    template_fallback: serve ChatML where that check fails, instead of answering 500.
    api_key: requests without it as a Bearer token get a 401; allowed_hosts: requests whose
    Host names none of these get a 400 (None: any Host; access.allowed_hosts builds the list)."""
    if max_tokens_default != -1 and max_tokens_default < 1:
        raise ValueError(f"max_tokens_default={max_tokens_default} is invalid: must be >= 1, "
                         f"or -1 (until the context is full)")
    if max_body < 1:
        raise ValueError(f"max_body={max_body} is invalid: must be >= 1")
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: give a key, or None to serve without one")
    metrics = Metrics()
    prep = ThreadPoolExecutor(1, thread_name_prefix="slipstream-tokenize")
    # what is served; `model` is set last, once the rest is in place (handlers test it)
    served = SimpleNamespace(model=None, id=None, names=set(), created=0, worker=None,
                             draft_name=None, chat_default=0, completion_default=0,
                             template=None)
    lock = threading.Lock()  # attach (any thread) against the lifespan (the event loop)
    running = [False]
    t_created = time.monotonic()
    # the jobs of open requests, for end_requests; weak, so a finished request leaves by itself
    open_jobs: weakref.WeakSet[Job] = weakref.WeakSet()
    closing = SimpleNamespace(loop=None, now=False)  # the server's event loop; ending yet?

    def attach(m) -> None:
        """Serve `m` from now on (once; safe from any thread)."""
        worker = GenerationWorker(m, max_queue, on_done=metrics.generation_done,
                                  on_cancel=metrics.generation_cancelled,
                                  generate_kwargs={"spec_nodes": spec_nodes,
                                                   "spec_depth": spec_depth})
        metrics.watch(worker)
        # a test double without a ChatTemplate renders in its own chat_ids
        template = ServedTemplate.start(m.template, Path(m.path).name, template_fallback) \
            if isinstance(getattr(m, "template", None), ChatTemplate) else None
        with lock:
            if served.model is not None:
                raise RuntimeError("this app already serves a model")
            served.id = model_id or Path(m.path).stem
            served.names = {served.id, Path(m.path).name, *ALIASES}
            served.created = int(Path(m.path).stat().st_mtime) if Path(m.path).exists() else 0
            draft = getattr(m, "draft", None)
            served.draft_name = Path(draft.path).name if draft is not None else None
            served.chat_default, served.completion_default = default_max_tokens(
                max_tokens_default, m.ctx)
            served.worker, served.template = worker, template
            app.state.model, app.state.worker, app.state.template = m, worker, template
            served.model = m
            if running[0]:
                worker.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        closing.loop = asyncio.get_running_loop()
        with lock:
            running[0] = True
            if served.worker is not None:
                served.worker.start()
        yield
        with lock:
            running[0] = False
            worker, template = served.worker, served.template
        if worker is not None:
            worker.stop()
        if template is not None:
            template.close()
        prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="slipstream", summary="OpenAI-compatible server for GGUF models",
                  lifespan=lifespan, strict_content_type=False)
    app.state.model, app.state.worker, app.state.metrics = None, None, metrics
    app.state.template = None
    app.state.attach = attach

    def end_requests() -> None:
        """End every open request now, and refuse new ones (safe from any thread)."""
        loop = closing.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(end_all)
        except RuntimeError:  # the loop closed meanwhile: nothing is open
            pass

    def end_all() -> None:
        closing.now = True
        for job in list(open_jobs):
            # behind the tokens already queued: the client gets those, then the error
            job.items.put_nowait(shutting_down())
            job.cancel()

    app.state.end_requests = end_requests

    def refused(code: str) -> None:  # an early refusal by a middleware, counted as an error
        metrics.errors.labels(code).inc()

    # outermost last: metrics (counts every answer), Host, key, body limit (no body is read
    # for a client that may not talk here)
    app.add_middleware(BodyLimitMiddleware, max_body=max_body, on_refused=refused)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=api_key, on_refused=refused)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, hosts=allowed_hosts, on_refused=refused)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(chat_page)  # GET /: the chat page

    def ready():
        """What is served; a 503 while the model is still loading."""
        if served.model is None:
            raise APIError(503, "The model is still loading; retry in a few seconds (GET "
                           "/health answers 200 once it is ready).", type="server_error",
                           code="model_loading",
                           headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        return served

    def error_response(e: APIError) -> JSONResponse:
        metrics.errors.labels(e.code or e.type).inc()
        return e.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(from_validation(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if isinstance(e, BodyTooLarge):  # a body sent without a length ran past the limit
            return error_response(APIError(413, e.detail, code="request_too_large",
                                           headers={"Connection": "close"}))
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: "
                                       f"{e.detail}", code=code, headers=e.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type="server_error", code="internal_error"))

    def model_card() -> dict:
        s = ready()
        return {"id": s.id, "object": "model", "created": s.created, "owned_by": "slipstream"}

    @app.get("/health")
    async def health():
        s = served
        if s.model is None:
            return JSONResponse({"status": "loading",
                                 "loading_s": round(time.monotonic() - t_created, 1)},
                                status_code=503,
                                headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        return {"status": "ok", "model": s.id, "device": str(s.model.device),
                "ctx": s.model.ctx, "draft": s.draft_name, "queue_depth": s.worker.waiting,
                "max_queue": s.worker.max_queue, "running": int(s.worker.busy),
                "max_tokens_default": s.chat_default}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        check_model(name)
        return model_card()

    def check_model(name: str | None) -> None:
        s = ready()
        if name is not None and name not in s.names:
            raise APIError(404, f"The model {name!r} does not exist; this server serves "
                           f"{s.id!r}", param="model", code="model_not_found")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        s = ready()

        def prepare() -> list[int]:
            if isinstance(req.prompt, str):
                return s.model.tokenize(req.prompt)
            vocab = s.model.tokenizer.vocab_size
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})",
                                  param="prompt")
            return list(req.prompt)

        return await serve(request, req, Formatter(False, s.id, req.include_usage),
                           lambda: tokenize(prepare), s.completion_default, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        s = ready()
        messages = [m.for_template() for m in req.messages]

        async def prepare() -> list[int]:
            if s.template is None:
                return await tokenize(lambda: s.model.chat_ids(messages))
            # in a worker process, beside other renders and generation (templates.py)
            try:
                text = await s.template.pool.arender(messages)
            except SlipstreamError as e:
                raise from_template_failure(e, s.template.model_file,
                                            s.template.problem) from None
            return await tokenize(lambda: s.model.prompt_ids(text))

        return await serve(request, req, Formatter(True, s.id, req.include_usage), prepare,
                           s.chat_default, "messages")

    async def serve(request: Request, req, fmt: Formatter,
                    prepare: Callable[[], Awaitable[list[int]]], default_max_tokens: int,
                    prompt_param: str):
        t0 = time.perf_counter()
        check_model(req.model)
        model, worker = served.model, served.worker
        if req.max_tokens is not None and req.max_tokens > model.ctx:
            param = ("max_completion_tokens" if getattr(req, "max_completion_tokens", None)
                     is not None else "max_tokens")
            raise bad_request(f"{param}={req.max_tokens} is more than this model's context "
                              f"holds: {model.ctx} tokens, the prompt included. Ask for "
                              f"fewer, or start the server with a larger --ctx.", param=param)
        ids = await prepare()
        if closing.now:
            raise shutting_down()
        if not ids:
            raise bad_request("the prompt is empty (it has no tokens)", param=prompt_param)
        if len(ids) >= model.ctx:
            raise APIError(400, f"This model's maximum context length is {model.ctx} tokens, "
                           f"but the prompt has {len(ids)} tokens (and at least one token must "
                           f"be generated). Shorten the prompt or start the server with a "
                           f"larger --ctx.", param=prompt_param, code="context_length_exceeded")
        try:
            job = worker.submit(ids, req.sampling_kwargs(default_max_tokens))
        except QueueFull as e:
            raise APIError(503, f"The server is busy: {e}. Retry after {e.retry_after_s} s.",
                           type="server_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        open_jobs.add(job)
        if req.stream:
            return StreamingResponse(stream(job, fmt, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await collect(job, fmt, request, t0)

    async def tokenize(prepare: Callable[[], list[int]]) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(prep, prepare)
        except APIError:
            raise
        except (SlipstreamError, jinja2.TemplateError, ValueError) as e:
            raise bad_request(f"the prompt could not be prepared: {e}") from None

    async def collect(job: Job, fmt: Formatter, request: Request, t0: float) -> dict:
        watcher = asyncio.create_task(cancel_on_disconnect(request, job))
        parts: list[str] = []
        try:
            async for item in job.events():
                if isinstance(item, Done):
                    return fmt.response("".join(parts), item)
                if item.index == 0:
                    metrics.ttft.observe(time.perf_counter() - t0)
                parts.append(item.text)
        except SlipstreamError as e:
            raise from_slipstream(e) from None
        finally:
            watcher.cancel()
            job.cancel()
        raise AssertionError("unreachable: a job always ends with Done")

    async def stream(job: Job, fmt: Formatter, t0: float) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; `finally` then
        # cancels the job, which stops the generation at its next token.
        try:
            if fmt.chat:
                yield fmt.chunk("", role=True)
            async for item in job.events():
                if isinstance(item, Done):
                    if fmt.include_usage:
                        yield fmt.usage_chunk(item)
                    break
                assert isinstance(item, GenerationEvent)
                if item.index == 0:
                    metrics.ttft.observe(time.perf_counter() - t0)
                if item.text:
                    yield fmt.chunk(item.text)
                if item.finish_reason:
                    yield fmt.chunk(None if fmt.chat else "", item.finish_reason)
            yield DONE_LINE
        except Exception as e:  # the status line is gone already: report in the stream
            if isinstance(e, APIError):  # end_requests: the server is shutting down
                err = e
            elif isinstance(e, SlipstreamError):
                err = from_slipstream(e)
            else:
                err = APIError(500, f"internal error: {type(e).__name__}: {e}",
                               type="server_error", code="internal_error")
            metrics.errors.labels(err.code or err.type).inc()
            yield sse(err.body())
            yield DONE_LINE
        finally:
            job.cancel()

    if model is not None:
        attach(model)
    return app


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; this request was ended before it "
                    "finished. Retry it once the server is back.", type="server_error",
                    code="server_shutting_down")


async def cancel_on_disconnect(request: Request, job: Job, poll_s: float = 0.25) -> None:
    """Non-streamed requests: nothing writes to the socket until the end, so poll for a
    disconnect and cancel the job when the client is gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)
    job.cancel()
