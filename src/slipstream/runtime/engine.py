"""The forward pass over a sequence: embedding, every block, final norm and head.

The engine owns the KV cache and the position; callers feed it token ids. Prefill runs the whole
prompt as one batch through each layer. Decode is one token; on CUDA it replays a captured CUDA
graph, so a step costs one launch from the host and never waits on the GPU.
"""

from __future__ import annotations

import time

import torch

from ..config import ModelConfig
from ..errors import ContextOverflow
from ..model import RopeTable, Step, block_forward, causal_mask, rms_norm
from ..weights import ModelWeights
from .kv_cache import KVCache

# Prompts longer than this are prefilled in chunks of it, which bounds the attention scores'
# memory ((heads, chunk, ctx) floats) without giving up batching.
PREFILL_CHUNK = 2048

# A captured decode graph reads a fixed number of cache slots. One graph per bucket of this many
# positions keeps the wasted attention reads under one bucket while capturing at most
# ctx / GRAPH_BUCKET graphs, each on first use.
GRAPH_BUCKET = 256


class Engine:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device,
                 ctx: int, act_dtype: torch.dtype, kv_dtype: torch.dtype,
                 use_graphs: bool | None = None, layers=None):
        self.cfg = cfg
        self.weights = weights
        self.device = device
        self.ctx = ctx
        self.act_dtype = act_dtype
        self.kv = KVCache(cfg, ctx, device, kv_dtype)
        self.rope = RopeTable(cfg, ctx, device, weights.rope_freqs)
        from ..memory import ResidentLayerStore

        # Where each layer comes from on every forward: built at load time, or streamed.
        self.layers = layers if layers is not None else ResidentLayerStore(weights.layers)
        if use_graphs is None and not isinstance(self.layers, ResidentLayerStore):
            use_graphs = False  # a captured graph would freeze one set of streamed weights
        self.pos = 0  # tokens already in the KV cache
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._token_buf: torch.Tensor | None = None  # (1,) static decode input
        self._pos_buf: torch.Tensor | None = None  # (1,) static decode position
        self.graph_capture_s = 0.0  # total time spent capturing, reported apart from runs

    def reset(self) -> None:
        self.pos = 0

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.ctx:
            raise ContextOverflow(f"{self.pos + n} tokens do not fit the context of {self.ctx} "
                                  f"tokens; use a shorter prompt or a larger --ctx")

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], all_logits: bool = False) -> torch.Tensor:
        """Append tokens to the context; return float32 logits (T, vocab) or (1, vocab).

        Tokens go through every layer as one batch (chunked past PREFILL_CHUNK).
        """
        ids = torch.as_tensor(tokens, dtype=torch.long)
        T = int(ids.shape[0])
        if T == 0:
            raise ValueError("forward() needs at least one token")
        self._check_room(T)
        outs = []
        for start in range(0, T, PREFILL_CHUNK):
            chunk = ids[start: start + PREFILL_CHUNK].to(self.device)
            positions = torch.arange(self.pos, self.pos + chunk.shape[0], device=self.device)
            span = self.pos + chunk.shape[0]
            mask = causal_mask(positions, span, self.cfg.gqa_group) if chunk.shape[0] > 1 \
                else None
            step = Step(positions, span=span, start=self.pos, mask=mask)
            h = self._hidden(chunk, step)
            self.pos += chunk.shape[0]
            outs.append(h if all_logits else h[-1:])
        h = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self._logits(h)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """One decode step on a (1,) token tensor (may live on the device: no host sync).

        Returns float32 logits (1, vocab). On CUDA with graphs this replays a captured graph and
        the returned tensor is a static buffer, overwritten by the next step.
        """
        self._check_room(1)
        if not self.use_graphs:
            return self.forward(token.view(1))
        bucket = min(self.ctx, (self.pos // GRAPH_BUCKET + 1) * GRAPH_BUCKET)
        if bucket not in self._graphs:
            self._capture(bucket)
        graph, logits = self._graphs[bucket]
        self._token_buf.copy_(token.view(1), non_blocking=True)
        self._pos_buf.fill_(self.pos)
        graph.replay()
        self.pos += 1
        return logits

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.weights.output_norm, self.cfg.norm_eps)
        return self.weights.output(h).float()

    def _hidden(self, ids: torch.Tensor, step: Step) -> torch.Tensor:
        cos_sin = self.rope.angles(step.positions)
        x = self.weights.embed(ids).to(self.act_dtype)  # (T, hidden)
        for i in range(self.cfg.n_layers):
            layer = self.layers.acquire(i)
            k_cache, v_cache = self.kv.layer(i)
            x = block_forward(self.cfg, layer, x, cos_sin, step, k_cache, v_cache, self.rope)
            self.layers.release(i)
        return x

    def _decode_body(self, span: int) -> torch.Tensor:
        step = Step(self._pos_buf, span=span, start=None,
                    mask=causal_mask(self._pos_buf, span, self.cfg.gqa_group))
        return self._logits(self._hidden(self._token_buf, step))

    def _capture(self, span: int) -> None:
        t0 = time.perf_counter()
        if self._token_buf is None:
            self._token_buf = torch.zeros(1, dtype=torch.long, device=self.device)
            self._pos_buf = torch.zeros(1, dtype=torch.long, device=self.device)
        # Warm up on a side stream (compiles Triton kernels, allocates workspaces), writing to
        # a cache slot no real step has reached yet; then capture.
        saved = self.pos
        self._pos_buf.fill_(self.ctx - 1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_body(span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._decode_body(span)
        torch.cuda.synchronize(self.device)
        self.pos = saved
        self._graphs[span] = (graph, logits)
        self.graph_capture_s += time.perf_counter() - t0
