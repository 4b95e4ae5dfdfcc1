"""slipstream's download bar (rich, on stderr), and a tqdm class that feeds it, for
huggingface_hub's `tqdm_class=`."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TaskID, TimeRemainingColumn,
                           TransferSpeedColumn)


@contextmanager
def download_bar(quiet: bool = False) -> Iterator[Progress]:
    """A rich Progress on stderr (stdout carries only the model's path), drawn only on a
    terminal and not at all when quiet. Transient: the caller's one line says what came of
    it, and an error stays one line."""
    console = Console(stderr=True)
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                  disable=quiet or not console.is_terminal, transient=True) as bar:
        yield bar


def hub_tqdm(bar: Progress, label: str) -> type:
    """A tqdm subclass whose bars become tasks of `bar`. tqdm still does the bookkeeping
    huggingface_hub relies on (n, total, format_dict, set_postfix_str, a lock for threads);
    only its drawing goes to /dev/null. Plain tqdm, not huggingface_hub's subclass: that one
    would disable itself, its output (/dev/null) being no terminal; `bar` decides instead."""
    from tqdm import tqdm  # local: huggingface_hub's dependency, needed only for Hub pulls

    class RichTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            self._task: TaskID | None = None  # tqdm's __init__ already refreshes
            self._null = open(os.devnull, "w")  # noqa: SIM115 (closed in close())
            kwargs["file"] = self._null
            super().__init__(*args, **kwargs)
            if not self.disable:
                self._task = bar.add_task(label, total=self.total, completed=self.n)

        def _push(self) -> None:
            if self._task is not None:
                bar.update(self._task, completed=self.n, total=self.total)

        def update(self, n=1):
            r = super().update(n)
            self._push()
            return r

        def refresh(self, *args, **kwargs):
            r = super().refresh(*args, **kwargs)
            self._push()
            return r

        def close(self):
            self._push()
            super().close()
            self._null.close()

    return RichTqdm
