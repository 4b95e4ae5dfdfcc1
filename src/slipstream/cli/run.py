"""`slipstream run`: generate text from a prompt, streamed to stdout."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from rich.markup import escape

from ..runtime import trace
from .loading import load_model
from .control import stream
from .options import DEFAULT_PROMPT, add_draft_args, add_model_args, add_sampling_args, \
    sampling_kwargs, spec_kwargs
from .render import breakdown_table, err, print_balance, print_spec, print_stats


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    r = command("run", "generate text from a prompt")
    add_model_args(r)
    r.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                   help=f"the prompt; - reads it from stdin (default: {DEFAULT_PROMPT!r})")
    r.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FILE",
                   help="read the prompt from a UTF-8 file, instead of -p (default: none)")
    r.add_argument("--stats", action="store_true", help="print the tier plan and a per-token "
                   "time breakdown (and speculative decoding's acceptance, with a draft)")
    r.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome/Perfetto trace of each token (per layer: disk read, "
                   "rebuild or host-to-device copy, compute, each on its own track) to FILE, "
                   "for ui.perfetto.dev or chrome://tracing (default: none)")
    add_sampling_args(r, 128)
    add_draft_args(r)
    r.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """Exit status 130 when Ctrl-C stopped the generation, as a shell reports SIGINT."""
    t0 = time.perf_counter()
    model = load_model(a)
    store = model.engine.layers
    store.stats.reset()
    if a.stats:
        store.enable_timing()
    tracer = None
    if a.trace is not None:  # after enable_timing: tracing shares its timeline on CUDA
        tracer = trace.Tracer()
        trace.attach(model, tracer)
    aborted = False  # a second Ctrl-C, which may have cut into the store's work
    events = None
    try:
        events = model.generate(a.prompt, **sampling_kwargs(a, model.ctx), **spec_kwargs(a))
        interrupted = stream(tracer.tokens(events) if tracer is not None else events,
                             engine=model.engine)
    except KeyboardInterrupt:
        interrupted = aborted = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = events.stats if events is not None else None
    print_stats(stats, a.load_s, time.perf_counter() - t0, interrupted)
    if (a.stats or tracer is not None) and not aborted:
        store.collect()  # CUDA: the last pass's events
    if a.stats and not aborted and stats is not None and stats.generated_tokens:
        err.print(breakdown_table(stats, store.stats, model.device.type))
        print_balance(store)
        print_spec(stats)
    if tracer is not None:
        tracer.write(a.trace)
        err.print(f"[dim]trace: {escape(a.trace)} ({len(tracer.spans())} spans; open it in "
                  f"ui.perfetto.dev or chrome://tracing)[/dim]", highlight=False, soft_wrap=True)
    return 130 if interrupted else 0
