"""What the commands print besides the generated text: the timings line, the speculative
decoding table, hybrid decode's balance, the per-token time breakdown and the notes after a
load (skipped layers, the tier plan). All of it goes to stderr, through `err`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from ..api import Model
    from ..memory.protocol import StoreStats
    from ..runtime.generate import GenerationStats

err = Console(stderr=True)


def summary(s: GenerationStats, load_s: float | None = None, total_s: float | None = None,
            interrupted: bool = False) -> str:
    """One generation's timings on one line, like llama.cpp's: load, prompt eval (prefill:
    tokens, time, tok/s), eval (decode: tokens, time, tok/s, ms per token) and total. The first
    generated token comes from the prefill's logits, so decode's rates count the tokens after
    it."""
    steps = max(s.generated_tokens - 1, 0)
    ms_per_token = s.decode_s / steps * 1e3 if steps else 0.0
    parts = [f"load {load_s:.2f} s"] if load_s is not None else []
    parts += [f"prompt {s.prompt_tokens} tok in {s.prefill_s * 1e3:.1f} ms "
              f"({s.prefill_tok_s:.1f} tok/s)",
              f"generated {s.generated_tokens} tok, decode {s.decode_s * 1e3:.1f} ms "
              f"({s.decode_tok_s:.1f} tok/s, {ms_per_token:.1f} ms/tok)"]
    if total_s is not None:
        parts.append(f"total {total_s:.2f} s")
    finish = s.finish_reason or ("interrupted" if interrupted else "none")
    return " | ".join(parts) + f" | finish: {finish}"


def print_stats(s: GenerationStats | None, load_s: float | None = None,
                total_s: float | None = None, interrupted: bool = False) -> None:
    """The timings line of one generation's stats (None: nothing was generated)."""
    if s is not None:
        err.print(f"[dim]{summary(s, load_s, total_s, interrupted)}[/dim]",
                  highlight=False, soft_wrap=True)


def spec_table(extra: dict) -> Table | None:
    """Speculative decoding's figures of one generation (GenerationStats.extra), or None when
    it decoded plainly. Times are per target pass: what a pass costs is what the tokens it
    yields have to pay for."""
    if "spec_target_passes" not in extra:
        return None
    passes = extra["spec_target_passes"]
    per_pass = max(passes, 1)
    timed = max(extra.get("spec_verify_passes", passes), 1)
    t = Table(title="speculative decoding", show_header=False)
    t.add_column("figure", style="bold")
    t.add_column("value", justify="right")
    hist = extra.get("spec_accepted_hist") or []
    rows = [("tokens per target pass", f"{extra['spec_tokens_per_pass']:.2f}"),
            ("target passes", str(passes)),
            ("mean tree nodes", f"{extra['spec_tree_nodes_mean']:.1f}"),
            ("accepted drafted tokens: passes", "  ".join(f"{a}: {n}" for a, n in
                                                          enumerate(hist)) or "-"),
            ("draft ms / pass", f"{extra['spec_draft_s'] / per_pass * 1e3:.1f}"),
            ("verify ms / pass", f"{extra['spec_verify_s'] / timed * 1e3:.1f}"),
            ("draft forwards / pass", f"{extra.get('spec_draft_forwards', 0) / per_pass:.1f}"),
            ("draft prefill ms", f"{extra.get('spec_draft_prefill_s', 0.0) * 1e3:.1f}")]
    # figures a source reports only where it has them (the sizer's plain steps, its choices)
    rows += [(label, str(extra[key])) for key, label in
             (("spec_plain_steps", "plain steps (no tree)"),
              ("spec_plain_after_give_up", "of which after the draft was given up"),
              ("spec_nodes", "tree node budget"),
              ("spec_depth", "tree depth budget")) if key in extra]
    for name, value in rows:
        t.add_row(name, value)
    return t


def print_spec(s: GenerationStats | None) -> None:
    """Speculative decoding's table of one generation's stats, where it speculated."""
    table = spec_table(s.extra) if s is not None else None
    if table is not None:
        err.print(table)


def print_balance(store) -> None:
    """Hybrid decode's running balance (hybrid.balance), where it changed the split."""
    balance = getattr(store, "balance", None)
    if balance is None or not balance.changes:
        return
    copies = f", the copies {balance.pcie_measured:.1f}" if balance.pcie_measured else ""
    err.print(f"[dim]hybrid: the CPU computes {len(store.active)} of {len(store.hosts)} split "
              f"layers (it measured {balance.cpu_gbps or 0:.1f} GB/s{copies}; the split "
              f"changed {len(balance.changes)} times while decoding, to follow the rates)[/dim]",
              soft_wrap=True)


def breakdown_table(s: GenerationStats, store: StoreStats, device: str) -> Table:
    """Where a token's time went (prefill and decode together), as a table.

    CPU: compute, waiting for disk reads, dequantizing streamed layers. CUDA: the GPU's busy
    time on the layers, its idle time between layers (a stall: waiting for a copy or for the
    host), and the rest (embedding, head, sampling, Python); then the links, which overlap
    with those: host-to-device copies, disk reads and hybrid decode's CPU share, with the GB/s
    each achieved."""
    tokens = max(s.prompt_tokens + s.generated_tokens, 1)
    total = s.prefill_s + s.decode_s
    t = Table(title="time per token (prefill and decode together)")
    for col in ("part", "ms / token", "share", "GB/s"):
        t.add_column(col, justify="right" if col != "part" else "left")

    def row(name: str, sec: float, share: bool = True, gbps: str = "") -> None:
        t.add_row(name, f"{sec / tokens * 1e3:.2f}",
                  f"{sec / total:.0%}" if total and share else "", gbps)

    if device == "cpu" or not store.layers_streamed:
        parts = [("disk wait", store.disk_wait_s), ("build streamed layers", store.build_s)]
        if store.expert_misses:  # cold experts, read on the main thread as they are routed to
            parts.append(("read cold experts", store.expert_read_s))
        row("compute", max(total - sum(p[1] for p in parts), 0.0))
        for name, sec in parts:
            row(name, sec)
        t.add_row("host-to-device, stall", "n/a on CPU" if device == "cpu" else
                  "none: every layer is resident", "", "")
        if store.cpu_s:  # a mixture of experts split with the CPU: the CPU's experts
            row("experts on the CPU (host, waits included)", store.cpu_s, False,
                f"{store.cpu_bytes / store.cpu_s / 1e9:.1f}")
    else:
        row("compute (GPU busy on layers)", store.compute_s)
        row("stall (GPU idle between layers)", store.stall_s)
        row("  disk wait (host blocked on a read)", store.disk_wait_s, False)
        row("other (embedding, head, host)", max(total - store.compute_s - store.stall_s, 0.0))
        rate = f"{store.h2d_bytes / store.h2d_s / 1e9:.1f}" if store.h2d_s else "-"
        row("host-to-device (copy stream busy)", store.h2d_s, False, rate)
        rate = f"{store.disk_bytes / store.disk_read_s / 1e9:.2f}" if store.disk_read_s else "-"
        row("disk reads (reader busy)", store.disk_read_s, False, rate)
        if store.cpu_s:  # hybrid decode: the CPU's FFN shares, from input to hand-back
            row("hybrid CPU share (host, waits included)", store.cpu_s, False,
                f"{store.cpu_bytes / store.cpu_s / 1e9:.1f}")
    t.caption = (f"{store.layers_streamed} streamed layer loads; {store.disk_bytes / 1e6:.1f} MB "
                 f"read from disk, {store.h2d_bytes / 1e6:.1f} MB copied to the GPU; links "
                 f"overlap compute, so their shares are not added")
    vram = store.expert_vram_rate
    if vram is not None:
        t.caption += (f"\nexperts split with the CPU: VRAM hit rate {vram:.1%} "
                      f"({store.expert_vram_pairs} routed pairs on the GPU, "
                      f"{store.expert_cpu_pairs} on the CPU); {store.expert_syncs} host syncs "
                      f"for routing; {store.expert_swaps} swaps into VRAM "
                      f"({store.expert_swap_bytes / 1e6:.1f} MB)")
        if store.expert_streamed:
            t.caption += (f"; prefill streamed {store.expert_streamed} experts to the GPU "
                          f"({store.expert_stream_bytes / 1e6:.1f} MB, "
                          f"{store.expert_stream_pairs} routed pairs)")
    rate = store.expert_hit_rate
    if rate is not None:
        t.caption += (f"\nexperts: {store.expert_hits} calls from RAM, {store.expert_misses} read "
                      f"from disk ({store.expert_bytes_read / 1e6:.1f} MB): hit rate {rate:.1%}")
    ahead = store.expert_ahead_rate
    if ahead is not None:
        t.caption += (f"\nread ahead: {store.expert_ahead_hits} of {store.expert_misses} cold "
                      f"experts guessed ({ahead:.1%}), {store.expert_ahead_reads} read "
                      f"({store.expert_ahead_bytes / 1e6:.1f} MB), "
                      f"{store.expert_ahead_reads - store.expert_ahead_hits} wasted")
    return t


def print_load_notes(model: Model, stats: bool) -> None:
    """After a load: the layers left out (--skip-layers), and the tier plan where layers
    stream or --stats asks for it, with the store's note."""
    if model.skipped_layers:
        sims = model.layer_similarities
        chosen = ", ".join(f"{i} ({sims[i]:.4f})" for i in model.skipped_layers)
        # one line however many layers (soft_wrap): scripts parse it
        err.print(f"skipping layers {chosen} [dim](cosine similarity of input and output on "
                  f"the calibration text)[/dim]", soft_wrap=True)
    if model.plan is not None and (model.plan.streamed_layers or stats):
        err.print(model.plan.table())
        note = model.engine.layers.note
        if note:
            err.print(f"[yellow]{escape(note)}[/yellow]")
