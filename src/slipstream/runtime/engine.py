"""The forward pass over a sequence: embedding, every stage's blocks, final norm and head.

The engine chains stages (runtime.stage: a device, a range of layers, their store, KV cache and
RoPE table) and moves the hidden state across each boundary; the embedding runs on the first
stage's device and the head on the last one's. Callers feed token ids and, optionally, a Step
built outside (model.step: positions, KV slots, attention mask), such as a tree of drafted
tokens. Prefill runs the whole prompt as one batch through each layer. Decode is one token; on
CUDA with every layer resident it replays a captured CUDA graph (runtime.graphs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Sequence

import torch

from ..errors import RecurrentState
from ..memory.store import ResidentLayerStore
from ..model import RopeTable, Step, append_step, block_forward, fused_decode_serves
from ..model.llama import LayerWeights, block_norm, uses_fused_decode
from ..model.ring import ring_step, wraps
from ..modelfile.config import ModelConfig
from ..weights import ModelWeights
from .graphs import GRAPH_BUCKET, DecodeGraphs, StepGraphs, bucket_span
from .kv_cache import KVCache
from .layer_graphs import LayerGraphs, layer_graphs_enabled
from .recurrent import RecurrentHistory, speculation_refused
from .stage import Stage

# Prompts longer than this are prefilled in chunks of it, which bounds the attention scores'
# memory ((heads, chunk, ctx) floats) without giving up batching.
PREFILL_CHUNK = 2048

__all__ = ["Engine", "GRAPH_BUCKET", "PREFILL_CHUNK"]


def captured_weights(weights: ModelWeights) -> ModelWeights:
    """`weights` as an engine whose steps are captured in CUDA graphs can use them: a streamed
    model keeps its token table on the host, and a lookup there copies the ids to the host,
    which no graph can hold, so the table is copied to where its rows are returned (a
    self-draft of a streamed target: api counts the copy in the draft's share)."""
    embed = weights.embed
    if embed is None or embed.raw.device == embed.device:
        return weights
    return dataclasses.replace(weights, embed=embed.on_device())


class Engine:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, stages: Sequence[Stage],
                 act_dtype: torch.dtype = torch.float32, use_graphs: bool | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, layers: range | None = None):
        """use_graphs: capture decode in CUDA graphs (default: when there is one stage and it
        can be captured, i.e. a CUDA device with every layer resident). prefill_chunk: the
        most tokens one forward runs at once (the plan's: its VRAM reserve holds their
        activations). layers: the layers the stages compute (default: all; a process of a
        pipeline computes its own range, runtime.pipeline)."""
        span = range(cfg.n_layers) if layers is None else layers
        if not stages or [i for st in stages for i in st.layers] != list(span):
            raise ValueError(f"the stages must cover layers {span.start}..{span.stop - 1} in "
                             f"order")
        self.cfg = cfg
        self.weights = weights
        self.stages = list(stages)
        self.act_dtype = act_dtype
        self.prefill_chunk = prefill_chunk
        capturable = len(self.stages) == 1 and self.stages[0].graph_capturable
        self.use_graphs = capturable if use_graphs is None else use_graphs
        self._graphs: DecodeGraphs | None = None
        self._tree_graphs: StepGraphs | None = None  # masked steps (a draft's tree levels)
        # eager decode steps (a streamed model): fixed layers through graphs of their own,
        # per stage (runtime.layer_graphs; SLIPSTREAM_LAYER_GRAPHS=1)
        self.layer_graphs = layer_graphs_enabled()
        self._layer_graphs: dict[int, LayerGraphs] = {}
        self._skip: frozenset[int] = frozenset()
        # Called as layer_hook(i, x_in, x_out) after each computed layer (runtime.layer_skip's
        # calibration records hidden states through it); None on every ordinary pass.
        self.layer_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # Called before each chunk and after each layer of an appended batch of more than one
        # token (a prompt's prefill); it raises to stop the pass there (runtime.interrupt:
        # Ctrl-C). A layer of a long prompt takes well under a second where a whole prefill
        # takes half a minute, so a stop there answers at once. The cache keeps the chunks
        # finished before (its length is set after each whole chunk).
        self.between_layers: Callable[[], None] | None = None
        # a model with linear-attention layers (Qwen3.5): the context's tokens and snapshots
        # of the states, which truncate restarts from (runtime.recurrent)
        self._history = (RecurrentHistory() if any(st.kv.recurrent for st in self.stages)
                         else None)

    # --- what the engine holds ----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where tokens enter (the first stage's device)."""
        return self.stages[0].device

    @property
    def ctx(self) -> int:
        return self.stages[0].kv.max_ctx

    @property
    def layers(self):
        """The first stage's layer store (with one stage, the model's)."""
        return self.stages[0].store

    @property
    def kv(self):
        return self.stages[0].kv

    @property
    def rope(self):
        return self.stages[0].rope

    @property
    def tree_graphs(self) -> StepGraphs | None:
        """The CUDA graphs of masked steps (a draft's tree levels), captured on first use;
        None before. Their `eager` set names the buckets that ran eagerly because their capture
        ran out of memory, which a benchmark of level costs must tell apart."""
        return self._tree_graphs

    @property
    def graph_capture_s(self) -> float:
        return (sum(g.capture_s for g in (self._graphs, self._tree_graphs) if g is not None)
                + sum(g.capture_s for g in self._layer_graphs.values()))

    # --- layer skip ---------------------------------------------------------------------------

    @property
    def skip(self) -> frozenset[int]:
        """Layers the forward pass leaves out (runtime.layer_skip chooses them): neither
        acquired from their store, so never streamed, nor computed; their KV slots stay as they
        are, since no later token reads them either."""
        return self._skip

    @skip.setter
    def skip(self, layers) -> None:
        """Set the skipped layers. The context is reset: the cached keys and values of
        the other layers were computed from hidden states the old set produced, so tokens that
        followed them under a new set would attend to a different model's cache. Each store is
        told, so that its read-ahead order leaves the skipped layers out."""
        new = frozenset(int(i) for i in layers)
        bad = sorted(i for i in new if not 0 <= i < self.cfg.n_layers)
        if bad:
            raise ValueError(f"cannot skip layers {bad}: the model has layers "
                             f"0..{self.cfg.n_layers - 1}")
        self._check_skip(new)
        self.reset()
        if new == self._skip:
            return
        self._skip = new
        self._graphs = self._tree_graphs = None  # captured graphs froze the old layers
        self._layer_graphs = {}
        stores = {id(st.store): st.store for st in self.stages}
        for store in stores.values():
            store.skip(new)

    def _check_skip(self, layers: frozenset[int]) -> None:
        read = sorted(layers & self.cfg.kv_sources())
        if read:
            raise ValueError(f"cannot skip layers {read}: later layers read their keys and "
                             f"values (a shared KV cache)")

    def self_draft(self, skip: frozenset[int] = frozenset(),
                   replace: Mapping[int, LayerWeights] | None = None,
                   share_kv: bool = False) -> "Engine":
        """A speculative self-draft: this engine's weights with `skip` left out.

        Without `replace` it runs on this engine's stores, which are not told of `skip` (they
        keep serving this engine, every layer in order), so every layer the draft runs must be
        resident: it only looks the layer up. `replace` (layer -> weights, speculative.lowbit's
        low-bit copy) gives the draft layers of its own for those indices; the others are this
        engine's resident layers (ValueError where one is neither). Either way decode can be
        captured in CUDA graphs.

        share_kv: the draft writes into this engine's KV caches instead of caches of its own:
        it reads the target's exact keys and values of the accepted prefix, needs no prefill
        and no catching up (speculative.rounds), and its tree's entries are overwritten by the
        verify pass that follows (SubSpec)."""
        self._check_skip(frozenset(skip))
        if self._history is not None:
            raise RecurrentState(speculation_refused(self.cfg))
        stages = []
        for st in self.stages:
            store = st.store
            if replace is not None:
                held = getattr(st.store, "layers", [])
                layers: list[LayerWeights | None] = [None] * self.cfg.n_layers
                for i in st.layers:
                    layer = replace.get(i)
                    if layer is None and i not in skip:
                        layer = held[i] if i < len(held) else None
                        if layer is None:
                            raise ValueError(f"layer {i} is neither in the draft's copy nor "
                                             f"resident in the target")
                    layers[i] = layer
                store = ResidentLayerStore(layers)
            kv = st.kv if share_kv else KVCache(self.cfg, st.kv.max_ctx, st.device,
                                                st.kv.dtype, len(st.layers), st.layers.start)
            stages.append(Stage(st.device, st.layers, store, kv, st.rope, st.rope_local))
        graphs = len(stages) == 1 and all(st.device.type == "cuda" for st in stages)
        draft = Engine(self.cfg, captured_weights(self.weights) if graphs else self.weights,
                       stages, self.act_dtype, use_graphs=graphs,
                       prefill_chunk=self.prefill_chunk)
        draft._skip = frozenset(skip)
        return draft

    def shares_kv(self, other: "Engine") -> bool:
        """Whether this engine writes into one of `other`'s KV caches (a self-draft made with
        share_kv)."""
        mine = {id(st.kv) for st in self.stages}
        return any(id(st.kv) in mine for st in other.stages)

    def release(self) -> None:
        """Drop every tensor the engine references (its stages' KV caches and stores, the
        weights, captured graphs and their pools), so that their memory goes back now even
        if something still holds the engine (a generation it was drafting for). The stores
        themselves are closed by their owner. The engine cannot run afterwards."""
        self.stages = []
        self.weights = None
        self._graphs = self._tree_graphs = None
        self._layer_graphs = {}

    # --- the context --------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Tokens in the KV cache (every stage's cache holds the same slots)."""
        return self.stages[0].kv.length

    def set_length(self, n: int) -> None:
        for st in self.stages:
            st.kv.length = n
        if n == 0 and self._history is not None:
            self._history.clear()

    def reset(self) -> None:
        self.set_length(0)

    def truncate(self, n: int) -> None:
        """Keep the first n cached tokens (a rejected draft's entries are dropped). A model
        with linear-attention layers restarts their states from the latest snapshot at or
        before n and runs the tokens from there to n again (runtime.recurrent)."""
        if self._history is not None and n < self.length:
            if n < 0:
                raise ValueError(f"cannot truncate a cache of {self.length} slots to {n}")
            tokens = self._history.tokens[:n]
            m, states = self._history.restart(n)
            for j, st in enumerate(self.stages):
                if states is None:
                    st.kv.length = 0
                else:
                    st.kv.restore(states[j], m)
            del self._history.tokens[m:]
            if n > m:
                self.forward(tokens[m:])
            return
        for st in self.stages:
            st.kv.truncate(n)

    def compact(self, src_slots: Sequence[int], dst_start: int) -> None:
        """Keep the entries of `src_slots` (an accepted branch) at dst_start onwards, drop the
        rest: every stage's cache moves the same slots."""
        for st in self.stages:
            st.kv.compact(src_slots, dst_start)

    def _check_room(self, n: int) -> None:
        self.stages[0].kv.check_room(self.length + n)

    # --- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor | list[int], all_logits: bool = False,
                step: Step | None = None, idle: Callable[[], bool] | None = None,
                last: int = 1) -> torch.Tensor:
        """Run tokens through the model; return float32 logits (T, vocab), or (last, vocab)
        for the last `last` tokens (at most T) unless all_logits.

        Without a step the tokens are appended to the context as one batch (chunked past
        self.prefill_chunk). With a step (built by the caller, e.g. `model.tree_step`), the tokens
        take its positions and slots and attend as its mask says; the cache length becomes
        `step.end`, which a caller may then `truncate` or `compact`.

        idle: called, instead of blocking, whenever the next layer's bytes are still being
        read (LayerStore.waiting), until it returns False (it has nothing left to do) or the
        bytes are there: a speculative draft grows its tree there while the target streams.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long)
        T = int(ids.shape[0])
        if T == 0:
            raise ValueError("forward() needs at least one token")
        if last < 1:
            raise ValueError(f"forward(last={last}): the rows of logits asked for must be >= 1")
        if step is not None:
            if self._history is not None:
                raise RecurrentState(
                    f"{self.cfg.architecture}'s linear-attention layers run only tokens "
                    f"appended in order, not a step at chosen positions (speculative trees)")
            if step.tokens != T:
                raise ValueError(f"the step describes {step.tokens} tokens, not {T}")
            self.stages[0].kv.check_room(step.end)
            if self.use_graphs and all_logits and self._step_graphs().serves(step):
                logits = self._step_graphs().run(ids.to(self.device), step)
            else:
                h = self._hidden(ids.to(self.device), step, idle)
                logits = self._logits(h if all_logits else h[-1:])
            self.set_length(step.end)
            return logits
        self._check_room(T)
        check = self.between_layers if T > 1 else None
        outs = []
        for start in range(0, T, self.prefill_chunk):
            if check is not None:
                check()
            chunk = ids[start: start + self.prefill_chunk].to(self.device)
            n = int(chunk.shape[0])
            h = self._hidden_kept(chunk, self._append_step(n), idle, check)
            self.set_length(self.length + n)
            if self._history is not None:
                self._history.append(chunk)
            outs.append(h if all_logits else h[-last:])
        if self._history is not None and T > 1:  # a prefill: a point truncate restarts from
            self._history.snapshot(self.length, [st.kv.states() for st in self.stages])
        h = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self._logits(h if all_logits else h[-last:])

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """One decode step on a (1,) token tensor (may live on the device: no host sync).

        Returns float32 logits (1, vocab). On CUDA with graphs this replays a captured graph and
        the returned tensor is a static buffer, overwritten by the next step.
        """
        self._check_room(1)
        if not self.use_graphs:
            return self.forward(token.view(1))
        if self._graphs is None:
            self._graphs = DecodeGraphs(self)
        return self._graphs.step(token)

    def _step_graphs(self) -> StepGraphs:
        if self._tree_graphs is None:
            self._tree_graphs = StepGraphs(self)
        return self._tree_graphs

    def run_step(self, ids: torch.Tensor, step: Step) -> torch.Tensor:
        """Logits (T, vocab) of ids at `step`, leaving the cache length alone (graph bodies)."""
        return self._logits(self._hidden(ids, step))

    def _block(self, cfg: ModelConfig, rope: RopeTable, window: int, layer: LayerWeights,
               cos_sin, k_cache: torch.Tensor, v_cache: torch.Tensor,
               per_layer: torch.Tensor | None, x: torch.Tensor, step: Step) -> torch.Tensor:
        """One layer (its config `cfg`: ModelConfig.layer) on x at `step`, as a layer graph
        captures it."""
        return block_forward(cfg, layer, x, cos_sin, step, k_cache, v_cache, rope, window,
                             per_layer)

    def _graphs_of(self, stage: Stage, step: Step) -> LayerGraphs | None:
        """The stage's graphs of single layers, where this step may use them: an eager decode
        step through the fused kernels (a streamed model's; a resident one replays whole-step
        graphs, inside whose capture this runs), with no layer hook to see each layer's
        tensors, on one GPU (a capture is made on the current device). The step's position
        goes into their static copy."""
        if (not self.layer_graphs or self.use_graphs or self.layer_hook is not None
                or len(self.stages) != 1 or stage.device.type != "cuda"
                or not uses_fused_decode(step, stage.kv.layer(0)[0])):
            return None
        graphs = self._layer_graphs.get(id(stage))
        if graphs is None:
            graphs = self._layer_graphs[id(stage)] = LayerGraphs(stage.device)
        graphs.begin_step(step)
        return graphs

    def _append_step(self, n: int) -> Step:
        """n tokens appended at the current length. A CUDA decode token reads its graph
        bucket's span, so an eager step (a streamed model) runs the fused decode kernels with
        the launch shape a captured graph uses, and gives the same bits."""
        first = self.stages[0]
        span = None
        if n == 1 and fused_decode_serves(first.kv.layer(0)[0]):
            span = bucket_span(self.length, self.ctx)
        return append_step(self.length, n, first.device, span)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = block_norm(self.cfg, h, self.weights.output_norm)
        logits = self.weights.output(h).float()
        if self.cfg.final_softcap:  # Gemma 4: c * tanh(logits / c)
            c = self.cfg.final_softcap
            logits = torch.tanh(logits / c) * c
        return logits * self.cfg.logit_scale if self.cfg.logit_scale != 1.0 else logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (T, hidden) in the activations' dtype, times the family's
        embedding scale (Gemma: sqrt(hidden))."""
        x = self.weights.embed(ids).to(self.act_dtype)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def _hidden_kept(self, ids: torch.Tensor, step: Step, idle: Callable[[], bool] | None,
                     check: Callable[[], None] | None) -> torch.Tensor:
        """_hidden of an appended chunk. A pass stopped between layers (Ctrl-C) leaves the
        cache at the chunks finished before, keys and values past the length unread; a
        linear-attention layer's state has no length, so it is put back as it was."""
        if self._history is None or check is None:
            return self._hidden(ids, step, idle, check)
        before = [st.kv.states() for st in self.stages]
        try:
            return self._hidden(ids, step, idle, check)
        except BaseException:
            for st, states in zip(self.stages, before):
                st.kv.restore(states, st.kv.length)
            raise

    def _hidden(self, ids: torch.Tensor, step: Step, idle: Callable[[], bool] | None = None,
                check: Callable[[], None] | None = None) -> torch.Tensor:
        x = self._embed(ids)  # (T, hidden), on the first device
        # Gemma 4's per-layer embedding inputs (T, n_layers, dim), made once per pass
        ple = (self.weights.per_layer.inputs(self.cfg, ids, x)
               if self.weights.per_layer is not None and self.cfg.per_layer_dim else None)
        for stage in self.stages:
            x = self._run_stage(stage, x, step, idle, check, ple)
        return x

    def _run_stage(self, stage: Stage, x: torch.Tensor, step: Step,
                   idle: Callable[[], bool] | None = None,
                   check: Callable[[], None] | None = None,
                   ple: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states x through one stage's layers (moved to its device first). ple:
        Gemma 4's per-layer embedding inputs (T, n_layers, dim), or None."""
        s = step.to(stage.device)
        if s.tokens > 1:
            s = s.with_mask(self.cfg.gqa_group)  # built once per stage, shared by its layers
        x = x.to(stage.device)
        cos_sin = stage.rope.angles(s.positions)
        # the sliding-window layers' RoPE angles
        rope_local = stage.rope_local or stage.rope
        cos_sin_local = (rope_local.angles(s.positions) if stage.rope_local is not None
                         else cos_sin)
        # each kind of layer's step, made on first use: a sliding-window layer's mask holds
        # its window (over its ring where the step reaches past it), and layers whose
        # key/value heads differ from the model's (Gemma 4) fold their query heads by their
        # own group
        steps: dict[tuple[int, ...], Step] = {(0, self.cfg.gqa_group): s}
        stage.store.begin_pass(s.tokens)
        first = stage.layers.start
        graphs = self._graphs_of(stage, s)
        for i in stage.layers:
            if i in self._skip:
                continue  # not acquired, so a streamed layer is never read or copied
            while idle is not None and stage.store.waiting(i):
                if not idle():
                    idle = None  # nothing left to do: block on the reads from here on
            layer = stage.store.acquire(i)
            k_cache, v_cache = stage.kv.layer(i - first)
            w = self.cfg.window_of(i)
            cfg = self.cfg.layer(i)
            rope, cs = ((rope_local, cos_sin_local) if self.cfg.sliding(i)
                        else (stage.rope, cos_sin))
            if s.needs_mask and wraps(s, w, k_cache):
                # a ring the step reaches past: its keys are the ring, then the step's own
                # (model.ring), under a mask made once per ring length and group
                ring = k_cache.shape[1]
                si = steps.get((w, cfg.gqa_group, ring))
                if si is None:
                    si = steps[w, cfg.gqa_group, ring] = ring_step(s, w, cfg.gqa_group, ring)
            else:
                si = steps.get((w, cfg.gqa_group))
            if si is None:
                si = steps[w, cfg.gqa_group] = (
                    s.with_window(w, cfg.gqa_group) if w else
                    dataclasses.replace(s, mask=None).with_mask(cfg.gqa_group))
            pl = ple[:, i] if ple is not None else None
            y = None
            if graphs is not None and stage.store.fixed(i):
                y = graphs.run(i, layer, x, functools.partial(
                    self._block, cfg, rope, w, layer, cs, k_cache, v_cache, pl), si.span)
            if y is None:  # eager: no graphs here, or this one's capture ran out of memory
                y = block_forward(cfg, layer, x, cs, si, k_cache, v_cache, rope, w, pl)
            stage.store.release(i)
            if self.layer_hook is not None:
                self.layer_hook(i, x, y)
            x = y
            if check is not None:  # the layer is released: the store is between layers
                check()
        return x
