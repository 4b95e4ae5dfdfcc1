"""The `slipstream` command: a thin shell over the Python API.

Generated text goes to stdout as it is produced; stats, progress and errors go to stderr. Every
deliberate error prints as one line and exits non-zero, never as a traceback; arguments are
checked before anything loads (rules). `--help` and `info` do not import torch: the API and the
model code are imported by the commands that run a model (loading).

One module per command, each owning its parser and its run function; options holds the options
they share, render what they print besides the text, control Ctrl-C and the ranks of a
distributed run.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from rich.markup import escape

from ..errors import PipelineBroken, SlipstreamError, SlipstreamWarning, oom_summary
from . import bench, cache, chat, info, perplexity, pull, quantize, run, serve, synth
from .control import exit_at_once
from .options import HelpFormatter, Parser, VersionAction
from .render import breakdown_table, err
from .rules import check_args

__all__ = ["breakdown_table", "build_parser", "check_args", "main", "parse_args"]

# in the order `slipstream --help` lists them (cache: list and rm)
COMMANDS = (run, chat, pull, cache, info, perplexity, bench, serve, quantize, synth)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slipstream", description="Run GGUF language models.",
               formatter_class=HelpFormatter)
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".",
                              formatter_class=HelpFormatter)

    for module in COMMANDS:
        module.add_parser(command)
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None,
                  _plain=warnings.showwarning) -> None:
    """slipstream's own warnings as one `warning:` line, like its errors (no source line)."""
    if not issubclass(category, SlipstreamWarning):
        return _plain(message, category, filename, lineno, file, line)
    err.print("[yellow]warning:[/yellow] " + escape(str(message)), highlight=False,
              soft_wrap=True)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line's namespace. `run MODEL -n 8 "prompt"`: argparse gives positionals
    only the words before the first option, so the words after it come back unrecognized and
    fill run's empty MODEL/PROMPT slots in order; anything else unrecognized is refused."""
    args, extra = parser.parse_known_args(argv)
    for slot in ("pos_model", "pos_prompt"):
        if extra and not extra[0].startswith("-") and getattr(args, slot, 0) is None:
            setattr(args, slot, extra.pop(0))
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command of `argv` (default: this process's arguments) and return its exit
    status. A command line of this process (argv None) that Ctrl-C stopped exits at once."""
    code = _main(argv)
    if code == 130 and argv is None:
        exit_at_once(code)
    return code


def _main(argv: list[str] | None) -> int:
    warnings.showwarning = _show_warning
    parser = build_parser()
    args = parse_args(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_args(args)
        return args.func(args)
    except SlipstreamError as e:
        err.print("[red]error:[/red] " + escape(str(e)), highlight=False, soft_wrap=True)
        if isinstance(e, PipelineBroken) and argv is None:
            # a process group whose peer vanished cannot be torn down: gloo's destructor may
            # abort the process at exit (SIGABRT), which would turn this error into a crash
            exit_at_once(1)
        return 1
    except RuntimeError as e:
        # a CUDA allocation the plan did not foresee (a VRAM budget is held by the allocator,
        # memory.vram_cap); torch is imported by then if it can happen
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        err.print("[red]error:[/red] the GPU ran out of memory ("
                  + escape(oom_summary(e)) + "); lower --ctx or the prompt, or raise --vram-budget",
                  highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into `head`): not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        # a filesystem failure the command did not turn into an error of its own (a cache
        # folder under a file, a read-only or full disk): one line naming the path
        where = f" ({e.filename})" if e.filename else ""
        err.print("[red]error:[/red] " + escape(f"{e.strerror or e}{where}; check that the "
                                              f"path exists and is writable, or set "
                                              f"SLIPSTREAM_CACHE to another folder"),
                  highlight=False, soft_wrap=True)
        return 1
