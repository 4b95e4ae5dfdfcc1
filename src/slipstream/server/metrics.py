"""Prometheus metrics of the server, in a registry of its own (one per app).

    slipstream_requests_total{endpoint, status}    HTTP requests answered
    slipstream_errors_total{code}                  requests answered with an error, by error code
    slipstream_cancelled_total{stage}              generations cancelled by a disconnect
                                                   (stage: waiting, prefill (between
                                                   prompt chunks) or running)
    slipstream_prompt_tokens_total                 prompt tokens processed
    slipstream_generated_tokens_total              tokens generated
    slipstream_decode_tokens_per_second            decode speed of the last finished generation
    slipstream_queue_depth                         requests waiting for the model
    slipstream_running                             generations running (0 or 1)
    slipstream_request_duration_seconds{endpoint}  request latency (to the last byte)
    slipstream_time_to_first_token_seconds         from arrival to the first generated token

With a draft (speculative decoding), after each generation that ran it:

    slipstream_spec_target_passes_total            the target's verify passes
    slipstream_spec_tokens_total                   tokens those passes yielded (divided by the
                                                   passes: tokens accepted per target pass)
    slipstream_spec_draft_seconds_total            time the draft spent growing trees
    slipstream_spec_verify_seconds_total           time the target spent verifying them
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .worker import Done, GenerationWorker

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, float("inf"))


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("slipstream_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("slipstream_errors", "Requests answered with an error",
                              ["code"], registry=r)
        self.cancelled = Counter("slipstream_cancelled", "Generations cancelled because the "
                                 "client went away", ["stage"], registry=r)
        self.prompt_tokens = Counter("slipstream_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generated_tokens = Counter("slipstream_generated_tokens", "Tokens generated",
                                        registry=r)
        self.decode_tok_s = Gauge("slipstream_decode_tokens_per_second",
                                  "Decode speed of the last finished generation", registry=r)
        self.queue_depth = Gauge("slipstream_queue_depth", "Requests waiting for the model",
                                 registry=r)
        self.running = Gauge("slipstream_running", "Generations running", registry=r)
        self.latency = Histogram("slipstream_request_duration_seconds", "Request latency to the "
                                 "last byte", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("slipstream_time_to_first_token_seconds", "From arrival to the "
                              "first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_passes = Counter("slipstream_spec_target_passes", "Speculative decoding: "
                                   "target verify passes", registry=r)
        self.spec_tokens = Counter("slipstream_spec_tokens", "Speculative decoding: tokens "
                                   "the target passes yielded", registry=r)
        self.spec_draft_s = Counter("slipstream_spec_draft_seconds", "Speculative decoding: "
                                    "seconds the draft spent growing trees", registry=r)
        self.spec_verify_s = Counter("slipstream_spec_verify_seconds", "Speculative decoding: "
                                     "seconds the target spent verifying trees", registry=r)

    def watch(self, worker: GenerationWorker) -> None:
        self.queue_depth.set_function(lambda: worker.waiting)
        self.running.set_function(lambda: int(worker.busy))

    def generation_done(self, done: Done) -> None:
        """Worker-thread callback after each generation (prometheus_client is thread-safe)."""
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generated_tokens.inc(done.completion_tokens)
        if done.completion_tokens > 1 and done.decode_s > 0:
            # the first token comes from the prefill logits, the rest from decode steps
            self.decode_tok_s.set((done.completion_tokens - 1) / done.decode_s)
        self._speculation(done.extra)

    def _speculation(self, extra: dict) -> None:
        """Add one generation's speculative figures (nothing when it decoded plainly)."""
        passes = extra.get("spec_target_passes")
        if not passes:
            return
        self.spec_passes.inc(passes)
        # the source reports a mean; passes x mean is the count it was taken from
        self.spec_tokens.inc(round(extra["spec_tokens_per_pass"] * passes))
        self.spec_draft_s.inc(extra.get("spec_draft_s", 0.0))
        self.spec_verify_s.inc(extra.get("spec_verify_s", 0.0))

    def generation_cancelled(self, stage: str) -> None:
        self.cancelled.labels(stage).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would get in the way of streaming and of
    disconnect detection): counts each response by endpoint and status, and its latency."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            if endpoint not in ("/metrics", "/health"):
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
