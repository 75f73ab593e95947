"""Progress of one pass step: a bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    s = int(max(0, seconds))
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """``rows done / total, rate, time left`` for one step of a pass.

    On a TTY a bar is redrawn in place (at most 10 times a second); otherwise a
    plain line is printed at most every *every* seconds, and one at the end.
    ``enabled=False`` prints nothing.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 tty: bool | None = None, every: float = 5.0, enabled: bool = True,
                 width: int = 30) -> None:
        self.label, self.total = label, max(0, total)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every, self.enabled, self.width = every, enabled, width
        self.done = 0
        self.t0 = time.monotonic()
        self._last = 0.0

    def _line(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.label}: {self.done}/{self.total} rows ({pct:.0f}%), "
                f"{rate:,.0f} rows/s, {_clock(left)} left")

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last >= 0.1:
                self._last = now
                self._draw()
        elif now - self._last >= self.every:
            self._last = now
            print(self._line(), file=self.stream, flush=True)

    def _draw(self) -> None:
        frac = self.done / self.total if self.total else 1.0
        fill = int(self.width * min(1.0, frac))
        bar = "#" * fill + "-" * (self.width - fill)
        self.stream.write(f"\r[{bar}] {self._line()}\x1b[K")
        self.stream.flush()

    def finish(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        else:
            print(self._line(), file=self.stream, flush=True)
