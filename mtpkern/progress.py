"""Progress on stderr for the command line.

On a terminal a bar is redrawn in place with ``\\r``; written to a pipe or a file
(CI logs, ``2> log``) a ``\\r`` would pile up as one long line, so there the
bar writes plain lines, or nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):            # no isatty, or a closed stream
        return False


class Progress:
    """A progress bar on ``stream`` (default stderr), shown once the run has taken
    ``after`` seconds. Not on a terminal: one plain line per ``update`` when
    ``lines``, else nothing."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, after: float = 1.0,
                 lines: bool = False):
        self.total, self.label = total, label
        self.stream = sys.stderr if stream is None else stream
        self.tty = is_terminal(self.stream)
        self.after, self.lines = after, lines
        self.t0 = time.perf_counter()
        self.last = -1.0
        self.shown = False

    def update(self, done: int, note: str = "") -> None:
        el = time.perf_counter() - self.t0
        if el < self.after or (self.tty and el - self.last < 0.2 and done < self.total):
            return
        if not (self.tty or self.lines):
            return
        self.shown, self.last = True, el
        frac = done / self.total if self.total else 1.0
        text = f"{self.label} [{'#' * int(30 * frac):<30}] {done}/{self.total}  {el:5.1f}s"
        if self.tty:
            eta = el / max(frac, 1e-9) - el
            self.stream.write(f"\r{text}  eta {eta:5.1f}s  {note:<24}")
        else:
            self.stream.write(f"{self.label}: {done}/{self.total}{' ' + note if note else ''}  {el:.1f}s\n")
        self.stream.flush()

    def close(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class WarmUpReport:
    """The ``progress`` callback of ``Backend.warm_up`` for the command line.

    Silent while the kernels load from the disk cache (about 0.5 s for all of them).
    Once the first family has taken more than ``threshold`` seconds it is compiling
    (rmsnorm alone compiles in 1.6 s on 2 cores), so it says so and shows a bar
    (plain lines when stderr is not a terminal). ``close`` says how long it took.
    """

    MESSAGE = "compiling kernels (first run only; later runs load them from the cache)"

    def __init__(self, stream: TextIO | None = None, threshold: float = 0.5):
        self.stream = sys.stderr if stream is None else stream
        self.threshold = threshold
        self.t0 = time.perf_counter()
        self.bar: Progress | None = None

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.bar is None:
            if done == 0 or time.perf_counter() - self.t0 < self.threshold:
                return
            self.stream.write(self.MESSAGE + "\n")
            self.bar = Progress(total, "kernels", stream=self.stream, after=0.0, lines=True)
            self.bar.t0 = self.t0
        if done < total:
            self.bar.update(done, f"next: {name}")
        elif self.bar.tty:                  # a full bar; close() says the rest
            self.bar.update(done)

    @property
    def compiled(self) -> bool:
        """True once the report decided the kernels were compiling."""
        return self.bar is not None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.stream.write(f"kernels ready in {time.perf_counter() - self.t0:.1f} s\n")
            self.stream.flush()


def warm_up(backend, stream: TextIO | None = None) -> int:
    """``backend.warm_up`` with a ``WarmUpReport`` on ``stream`` (stderr): silent when the
    kernels come from the cache. Returns what ``warm_up`` does."""
    report = WarmUpReport(stream)
    compiled = backend.warm_up(report)
    report.close()
    return compiled
