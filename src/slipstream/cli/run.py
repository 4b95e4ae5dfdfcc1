"""`slipstream run`: generate text from a prompt, streamed to stdout.

A model whose GGUF carries a chat template gets the prompt as one user message through it, as
`ollama run` and llama-cli's conversation mode do: an Instruct model asked raw completion of
"Hello" continues the text instead of answering. --raw, or a model without a template, sends
the prompt as it is."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from rich.markup import escape

from ..errors import ContextOverflow
from ..runtime import trace
from .loading import load_model
from .control import stream
from .options import DEFAULT_PROMPT, add_draft_args, add_model_args, add_sampling_args, \
    sampling_kwargs, spec_kwargs
from .render import breakdown_table, err, print_balance, print_spec, print_stats


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    r = command("run", "generate text from a prompt")
    r.add_argument("pos_model", nargs="?", default=None, metavar="MODEL",
                   help="the model, as -m takes it; a lone word that names no file, cached "
                   "model, URL or Hub file is the PROMPT instead")
    r.add_argument("pos_prompt", nargs="?", default=None, metavar="PROMPT",
                   help="the prompt, as -p takes it")
    add_model_args(r)
    r.add_argument("-p", "--prompt", default=None, metavar="TEXT",
                   help=f"the prompt; - reads it from stdin (default: {DEFAULT_PROMPT!r})")
    r.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FILE",
                   help="read the prompt from a UTF-8 file, instead of -p (default: none)")
    r.add_argument("--raw", action="store_true", help="complete the prompt as raw text, "
                   "without the model's chat template (a model without one always is)")
    r.add_argument("--stats", action="store_true", help="print the tier plan and a per-token "
                   "time breakdown (and speculative decoding's acceptance, with a draft)")
    r.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome/Perfetto trace of each token (per layer: disk read, "
                   "rebuild or host-to-device copy, compute, each on its own track) to FILE, "
                   "for ui.perfetto.dev or chrome://tracing (default: none)")
    add_sampling_args(r, 128, n_zero=True)
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
    events = stats = None
    ids = prompt_ids(model, a.prompt, a.raw)
    try:
        if a.max_tokens == 0:
            stats, interrupted = prefill_only(model, ids), False
        else:
            events = model.generate(ids, **sampling_kwargs(a, model.ctx), **spec_kwargs(a))
            interrupted = stream(tracer.tokens(events) if tracer is not None else events,
                                 engine=model.engine)
    except KeyboardInterrupt:
        interrupted = aborted = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    if events is not None:
        stats = events.stats
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


def prompt_ids(model, prompt: str, raw: bool) -> list[int]:
    """The prompt's token ids: through the model's chat template as one user message, unless
    --raw or the model has no template (a base model), then the text as it is."""
    if raw or model.template.is_fallback:
        return model.tokenize(prompt)
    return model.chat_ids([{"role": "user", "content": prompt}])


def prefill_only(model, ids: list[int]):
    """-n 0: the prompt's prefill alone in a fresh context, timed as generate() times it (the
    forward pass and the host's wait for its last logits), as llama.cpp's -n 0 evaluates the
    prompt and prints its timing."""
    import torch  # loaded with the model, as the stats' module is

    from ..runtime.generate import GenerationStats  # torch's, as above

    engine = model.engine
    if len(ids) >= engine.ctx:
        raise ContextOverflow(f"the prompt has {len(ids)} tokens but the context holds "
                              f"{engine.ctx}; shorten the prompt or raise --ctx")
    engine.reset()
    t0 = time.perf_counter()
    logits = engine.forward(ids)
    if logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
    return GenerationStats(prompt_tokens=len(ids), prefill_s=time.perf_counter() - t0,
                           finish_reason="length")
