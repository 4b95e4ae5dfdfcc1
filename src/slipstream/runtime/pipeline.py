"""One model over several processes: each process holds one stage, a contiguous
range of layers with its own KV cache, and the hidden states go from stage to stage by
torch.distributed send/recv (NCCL between GPUs, gloo on CPUs), launched by torchrun:

    torchrun --nproc-per-node 2 -m slipstream run -m MODEL --distributed "prompt"

Rank 0 holds the embedding and runs the generation (tokenizer, sampler, stop strings, the
output); the last rank holds the head. Every forward pass starts with a header from rank 0 to
every other rank (what the pass is), then the hidden states travel rank 0 -> 1 -> ... -> last,
and the last rank sends the logits back to rank 0, which samples there with the user's sampler
as a single process would: the same logits give the same tokens. Across machines it is the
same code with torchrun's --nnodes; no transport of our own.

Speculative decoding runs across processes too: the draft (a file, loaded whole on rank 0
only, out of rank 0's budgets) grows its trees on rank 0, and the target's verify pass is a
step (positions, slots, the tree's attention mask) that rank 0 sends every rank with the pass's
header; the walk's KV compaction is one more message. Every send and receive has the process
group's timeout (SLIPSTREAM_DIST_TIMEOUT, 60 s by default), so a rank that dies gives
rank 0 a PipelineBroken error naming the peer instead of a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from rich.table import Table

from .. import envs
from ..errors import BadArgument, PipelineBroken
from ..memory.budget import fmt_bytes
from ..memory.devices import REMOTE
from ..model import Step
from .engine import Engine

OP_FORWARD, OP_LENGTH, OP_TRUNCATE, OP_STOP, OP_STEP, OP_COMPACT = 1, 2, 3, 4, 5, 6
HEADER = 4  # int64s: op, tokens, rows (the last rows whose logits come back), value


@dataclass
class Pipeline:
    """This process's place in the pipeline."""

    rank: int
    world: int
    device: torch.device

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


def join(device: str | torch.device = "auto", timeout_s: float | None = None) -> Pipeline:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment), or the one already initialised: NCCL where this process has a GPU (the
    one LOCAL_RANK names), gloo on CPU. At least two processes."""
    if not dist.is_available():
        raise BadArgument("this torch build has no torch.distributed: --distributed needs it")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise BadArgument(f"--distributed runs one process per stage under torchrun "
                              f"({', '.join(missing)} unset): e.g. torchrun --nproc-per-node 2 "
                              f"-m slipstream run --distributed ...")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if str(device) == "auto":
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
    if not dist.is_initialized():
        seconds = timeout_s or envs.get("SLIPSTREAM_DIST_TIMEOUT")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise BadArgument("--distributed needs at least 2 processes (torchrun "
                          "--nproc-per-node 2); one process runs the model without it")
    return Pipeline(rank, world, dev)


def stage_rows(pipeline: Pipeline, plan) -> list[dict]:
    """Every rank's stage as rank 0 shows it (a collective: each rank calls it once, after its
    load): device, layer range, layers by tier, bytes held and its predicted ms per token."""
    stage = plan.stages[0]
    tiers: dict[str, int] = {}
    for t in plan.tiers:
        if t != REMOTE:
            tiers[t] = tiers.get(t, 0) + 1
    held = sum(b for b, t in zip(plan.resident_bytes_per_layer, plan.tiers)
               if t not in (REMOTE, "disk")) + plan.fixed_bytes
    tok_s = plan.predicted_tok_s
    mine = {"rank": pipeline.rank, "device": str(pipeline.device),
            "layers": f"{stage.layers.start}-{stage.layers.stop - 1}",
            "tiers": ", ".join(f"{n} {t}" for t, n in tiers.items()),
            "held": fmt_bytes(held), "ms_per_token": 1e3 / tok_s if tok_s else None,
            "holds": " + ".join(w for w, h in (("embedding", stage.holds_embedding),
                                               ("head", stage.holds_head)) if h)}
    rows: list = [None] * pipeline.world
    try:
        dist.all_gather_object(rows, mine)
    except RuntimeError as e:  # a rank whose load failed never joins the gather
        raise PipelineBroken(f"rank {pipeline.rank} loaded its stage but another rank did not "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); see that "
                             f"rank's error and restart every rank") from None
    return rows


def stage_table(rows: list[dict]):
    """The pipeline's plan, one row per rank; decode's prediction is the stages' times added
    (a token passes through them one after another)."""
    t = Table(title=f"pipeline plan ({len(rows)} processes)")
    for col in ("rank", "device", "layers", "tiers", "holds", "bytes held", "ms / token"):
        t.add_column(col, justify="left" if col in ("device", "tiers", "holds") else "right")
    for r in rows:
        ms = r["ms_per_token"]
        t.add_row(str(r["rank"]), r["device"], r["layers"], r["tiers"], r["holds"] or "-",
                  r["held"], f"{ms:.1f}" if ms else "-")
    times = [r["ms_per_token"] for r in rows]
    if all(times):
        total = sum(times)
        t.caption = (f"predicted decode: {total:.1f} ms/token, {1e3 / total:.2f} tok/s (the "
                     f"stages one after another, hand-overs not counted)")
    return t


def _step_wire(step: Step) -> list[torch.Tensor]:
    """A step as the tensors rank 0 sends (its attention mask as bytes: gloo moves no bool)."""
    head = torch.tensor([step.end, -1 if step.start is None else step.start, int(step.causal)],
                        dtype=torch.long)
    out = [head, step.positions.long(), step.slots.long()]
    if not step.causal:
        out.append(step.allowed.to(torch.uint8))
    return out


class PipelineEngine(Engine):
    """An Engine over this process's stage only: rank 0 drives the pipeline (forward, decode,
    the cache length) and the other ranks `serve` it (see the module doc)."""

    def __init__(self, *args, pipeline: Pipeline, **kw):
        super().__init__(*args, use_graphs=False, **kw)
        if self.cfg.per_layer_dim or self.cfg.kv_layers:
            # each rank would need every token's per-layer inputs, or another rank's cache
            raise BadArgument(f"{self.cfg.architecture}: per-layer embeddings and layers that "
                              f"reuse other layers' keys and values (Gemma 4 E2B/E4B) run in "
                              f"one process; load the model without --distributed")
        self.pipeline = pipeline
        self.stage = self.stages[0]
        self._stopped = False

    # --- rank 0 ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens, all_logits: bool = False, step: Step | None = None,
                idle: Callable[[], bool] | None = None, last: int = 1) -> torch.Tensor:
        self._driver_only("forward")
        if step is not None:
            return self._forward_step(tokens, all_logits, step)
        ids = torch.as_tensor(tokens, dtype=torch.long)
        T = int(ids.shape[0])
        if T == 0:
            raise ValueError("forward() needs at least one token")
        self._check_room(T)
        outs = []
        for start in range(0, T, self.prefill_chunk):
            chunk = ids[start: start + self.prefill_chunk].to(self.device)
            n = int(chunk.shape[0])
            rows = n if all_logits else min(last, n)  # a chunk's last rows come back
            self._tell(OP_FORWARD, n, rows)
            x = self._embed(chunk)
            x = self._run_stage(self.stage, x, self._append_step(n))
            self._send(x, 1)
            self.stage.kv.length += n
            outs.append(self._recv((rows, self.cfg.vocab_size), torch.float32,
                                   self.pipeline.world - 1))
        logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        return logits if all_logits else logits[-last:]

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        self._check_room(1)
        return self.forward(token.view(1))

    def set_length(self, n: int) -> None:
        if self.pipeline.first:
            self._tell(OP_LENGTH, value=n)
        super().set_length(n)

    def truncate(self, n: int) -> None:
        if self.pipeline.first:
            self._tell(OP_TRUNCATE, value=n)
        super().truncate(n)

    def compact(self, src_slots, dst_start: int) -> None:
        if self.pipeline.first:
            slots = torch.as_tensor(list(src_slots), dtype=torch.long)
            self._tell(OP_COMPACT, int(slots.shape[0]), value=dst_start)
            for r in range(1, self.pipeline.world):
                self._send(slots, r)
        super().compact(src_slots, dst_start)

    def _forward_step(self, tokens, all_logits: bool, step: Step) -> torch.Tensor:
        """Rank 0: a caller's step (a tree to verify) through every stage: the step goes to
        every rank with the header, the hidden states down the ranks, the logits back."""
        ids = torch.as_tensor(tokens, dtype=torch.long)
        T = int(ids.shape[0])
        if step.tokens != T:
            raise ValueError(f"the step describes {step.tokens} tokens, not {T}")
        self.stage.kv.check_room(step.end)
        rows = T if all_logits else 1
        self._tell(OP_STEP, T, rows, value=step.span)
        wire = _step_wire(step)
        for r in range(1, self.pipeline.world):
            for t in wire:
                self._send(t, r)
        x = self._embed(ids.to(self.device))
        x = self._run_stage(self.stage, x, step)
        self._send(x, 1)
        Engine.set_length(self, step.end)
        return self._recv((rows, self.cfg.vocab_size), torch.float32, self.pipeline.world - 1)

    def stop(self) -> None:
        """Rank 0: let the other ranks' `serve` return (at close)."""
        if self.pipeline.first and not self._stopped:
            self._stopped = True
            try:
                self._tell(OP_STOP)
            except PipelineBroken:
                pass  # a peer already gone has nothing left to stop

    # --- the other ranks ----------------------------------------------------------------------

    @torch.inference_mode()
    def serve(self) -> None:
        """Ranks after the first: run this stage's part of every pass rank 0 starts, until it
        stops the pipeline."""
        if self.pipeline.first:
            raise ValueError("rank 0 drives the pipeline; the other ranks serve it")
        p = self.pipeline
        while True:
            op, n, rows, value = self._recv((HEADER,), torch.long, 0).tolist()
            if op == OP_STOP:
                return
            if op == OP_LENGTH:
                super().set_length(value)
            elif op == OP_TRUNCATE:
                super().truncate(value)
            elif op == OP_COMPACT:
                slots = self._recv((n,), torch.long, 0)
                super().compact(slots.tolist(), value)
            elif op in (OP_FORWARD, OP_STEP):
                step = self._recv_step(n, value) if op == OP_STEP else self._append_step(n)
                x = self._recv((n, self.cfg.hidden), self.act_dtype, p.rank - 1)
                x = self._run_stage(self.stage, x, step)
                if op == OP_STEP:
                    super().set_length(step.end)
                else:
                    self.stage.kv.length += n
                if p.last:
                    self._send(self._logits(x[-rows:]), 0)
                else:
                    self._send(x, p.rank + 1)
            else:
                raise PipelineBroken(f"rank {p.rank} got an unknown pipeline op {op} from "
                                     f"rank 0")

    # --- messages -----------------------------------------------------------------------------

    def _recv_step(self, n: int, span: int) -> Step:
        """The step rank 0 sent after an OP_STEP header (_step_wire's tensors)."""
        end, start, causal = self._recv((3,), torch.long, 0).tolist()
        positions = self._recv((n,), torch.long, 0)
        slots = self._recv((n,), torch.long, 0)
        allowed = None if causal else self._recv((n, span), torch.uint8, 0).bool()
        return Step(positions, slots, span=span, end=end, start=None if start < 0 else start,
                    causal=bool(causal), allowed=allowed)

    def _driver_only(self, what: str) -> None:
        if not self.pipeline.first:
            raise ValueError(f"{what}() runs on rank 0; rank {self.pipeline.rank} serves")

    def _tell(self, op: int, tokens: int = 0, rows: int = 0, value: int = 0) -> None:
        header = torch.tensor([op, tokens, rows, value], dtype=torch.long)
        for r in range(1, self.pipeline.world):
            self._send(header, r)

    def _wire(self) -> torch.device:
        # gloo moves CPU tensors, NCCL device ones
        return self.pipeline.device if self.pipeline.device.type == "cuda" else \
            torch.device("cpu")

    def _send(self, t: torch.Tensor, peer: int) -> None:
        try:
            dist.send(t.contiguous().to(self._wire()), peer)
        except RuntimeError as e:  # DistBackendError too; gloo reports a dead peer so
            raise self._broken(peer, "send to", e) from None

    def _recv(self, shape, dtype, peer: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self._wire())
        try:
            dist.recv(t, peer)
        except RuntimeError as e:  # DistBackendError too; gloo reports a dead peer so
            raise self._broken(peer, "receive from", e) from None
        return t.to(self.device)

    def _broken(self, peer: int, what: str, e: BaseException) -> PipelineBroken:
        return PipelineBroken(f"rank {self.pipeline.rank} could not {what} rank {peer} "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}): that "
                              f"process died or stopped answering; restart every rank")
