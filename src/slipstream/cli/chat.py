"""`slipstream chat`: an interactive multi-turn chat on stdin and stdout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .loading import load_model
from .control import stream
from .options import add_draft_args, add_model_args, add_sampling_args, sampling_kwargs, \
    spec_kwargs
from .render import err, print_spec, print_stats


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    c = command("chat", "interactive multi-turn chat")
    add_model_args(c)
    c.add_argument("--system", default=None, help="system message (default: none)")
    c.add_argument("-v", "--verbose", action="store_true", help="print stats after each reply "
                   "(and speculative decoding's acceptance, with a draft)")
    add_sampling_args(c, 512)
    add_draft_args(c)
    c.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    model = load_model(a)
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    if interactive:
        err.print("[dim]chat with the model; Ctrl-C stops a reply, /reset clears the "
                  "conversation, /bye or Ctrl-D quits[/dim]", soft_wrap=True)
    idle_ctrl_c = False  # the last thing at the prompt was a Ctrl-C
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            if idle_ctrl_c:
                sys.stderr.write("\n")
                return 0
            idle_ctrl_c = True
            err.print("\n[dim](Ctrl-C again, Ctrl-D or /bye quits)[/dim]")
            continue
        idle_ctrl_c = False
        if not line:
            if interactive:
                sys.stderr.write("\n")
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            break
        if text == "/reset":
            messages = messages[:1] if a.system else []
            continue
        messages.append({"role": "user", "content": text})
        reply: list[str] = []
        # a stopped reply stays in the conversation as far as it went: what the user saw
        gen = model.chat(messages, **sampling_kwargs(a, model.ctx), **spec_kwargs(a))
        stopped = stream(gen, reply, model.engine)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
        if a.verbose:
            stats = gen.stats
            print_stats(stats, interrupted=stopped)
            print_spec(stats)
    return 0
