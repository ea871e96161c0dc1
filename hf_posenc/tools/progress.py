"""The progress policy of every command: one bar per stage (the fine-tune's steps; a model's evaluation windows
across its lengths). On a terminal it is a tqdm bar; on a pipe or a file (a saved log, CI, ``nohup``) it is a plain
line at the start, at most one every ``LOG_INTERVAL_SECONDS`` and one at the end: tqdm's carriage-return redraws
would fill a saved log with hundreds of half-lines (issue 57)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, TextIO

LOG_INTERVAL_SECONDS = 30.0


class _Off:
    """A disabled bar: every call does nothing; ``write`` still prints (the lines that matter)."""

    def __init__(self, iterable: Iterable | None = None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class LineProgress(_Off):
    """Progress as plain lines, ``desc: done/total unit (postfix), elapsed``: no carriage return, no redraw."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, unit: str, initial: int,
                 file: TextIO, interval: float, clock: Callable[[], float]):
        super().__init__(iterable)
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit, self.n, self.file = total, desc, unit, initial, file
        self.interval, self.clock, self.postfix, self.closed = interval, clock, "", False
        self.started = self.last = clock()
        self._line()

    def __iter__(self):
        for item in super().__iter__():
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.interval:
            self._line()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def _line(self) -> None:
        self.last = now = self.clock()
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        postfix = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: {done} {self.unit}{postfix}, {now - self.started:.0f} s", file=self.file, flush=True)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, enabled: bool = True, file: TextIO | None = None,
             interval: float = LOG_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic):
    """A bar for one stage: ``update(n)``, ``set_postfix(...)``, ``write(text)``, ``close()``, or iterate it.
    A tqdm bar when ``file`` (default: stderr) is a terminal; plain lines (``LineProgress``) otherwise."""
    if not enabled:
        return _Off(iterable)
    file = file if file is not None else sys.stderr
    if getattr(file, "isatty", lambda: False)():
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=file)
    return LineProgress(iterable, total, desc, unit, initial, file, interval, clock)


@contextmanager
def library_bars_on_a_terminal(file: TextIO | None = None) -> Iterator[None]:
    """transformers' and huggingface_hub's own bars (loading weights, writing shards) redraw with "\\r" too: off
    while a command runs with stderr not a terminal, and put back as they were after it."""
    file = file if file is not None else sys.stderr
    if getattr(file, "isatty", lambda: False)():
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    transformers_on, hub_on = hf_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        yield
    finally:
        if transformers_on:
            hf_logging.enable_progress_bar()
        if hub_on:
            enable_progress_bars()
