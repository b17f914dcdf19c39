"""Progress on stderr for the command line.

On a terminal a bar is redrawn in place with ``\\r``; written to a pipe or a file
(CI logs, ``2> log``) a ``\\r`` would pile up as one long line, so there the
bar writes plain lines, or nothing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, TextIO


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

    Silent while the kernels load from the disk cache. ``compiling()`` says that a kernel
    compiles (``warm_up`` below calls it on the warm-up's first Numba compile event: a load
    from the cache is none): from then on it shows a bar (plain lines when the stream is not
    a terminal), and ``close`` says how long it took.
    """

    MESSAGE = "compiling kernels (first run only; later runs load them from the cache)"

    def __init__(self, stream: TextIO | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.perf_counter()
        self.bar: Progress | None = None
        self.done, self.total, self.name = 0, 0, ""

    def __call__(self, done: int, total: int, name: str) -> None:
        self.done, self.total, self.name = done, total, name
        if self.bar is None:
            return
        if done < total:
            self.bar.update(done, f"next: {name}")
        elif self.bar.tty:                  # a full bar; close() says the rest
            self.bar.update(done)

    def compiling(self) -> None:
        """Something compiles: say so once, and show the bar from here on."""
        if self.bar is not None:
            return
        self.stream.write(self.MESSAGE + "\n")
        self.stream.flush()
        self.bar = Progress(max(self.total, 1), "kernels", stream=self.stream, after=0.0, lines=True)
        self.bar.t0 = self.t0
        if self.done < self.total:
            self.bar.update(self.done, self.name)

    @property
    def compiled(self) -> bool:
        """True once something compiled (``compiling`` was called)."""
        return self.bar is not None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.stream.write(f"kernels ready in {time.perf_counter() - self.t0:.1f} s\n")
            self.stream.flush()


@contextlib.contextmanager
def on_compile(callback: Callable[[], None]) -> Iterator[None]:
    """``callback()`` at the start of every Numba compile inside the block (none when a
    kernel loads from the disk cache); nothing to watch when Numba is not imported (the
    numpy and cuda backends)."""
    if "numba" not in sys.modules:
        yield
        return
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            callback()

        def on_end(self, ev: event.Event) -> None:
            pass

    with event.install_listener("numba:compile", Listener()):
        yield


def warm_up(backend, stream: TextIO | None = None, needs=None) -> int:
    """``backend.warm_up`` (only what ``needs`` names, when given: a ``KernelNeeds``) with a
    ``WarmUpReport`` on ``stream`` (stderr): silent unless a kernel compiles. Returns what
    ``warm_up`` does."""
    report = WarmUpReport(stream)
    with on_compile(report.compiling):
        compiled = backend.warm_up(report) if needs is None else backend.warm_up(report, needs=needs)
    report.close()
    return compiled
