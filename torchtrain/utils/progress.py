"""Progress of long offline work (data preparation, checkpoint conversion, layout search).

On a terminal a single line is redrawn in place::

    prepare  [##########----------]  51.2%  10.4M/20.3M tokens  1.32M tokens/s  ETA 0:00:07

When the output is not a terminal (a log file, CI, a pipe), a plain line is printed at most every
`interval` seconds instead, so logs stay readable::

    prepare: 10.4M/20.3M tokens (51.2%), 1.32M tokens/s, ETA 0:00:07

Rates are averaged over the whole run (robust for bursty work such as shards finishing in chunks).
Usage::

    with Progress("prepare", total=n_tokens, unit="tokens") as bar:
        for chunk in work:
            bar.update(len(chunk))
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import TextIO


def human(n: float) -> str:
    """1234 -> '1.23K', 12_345_678 -> '12.3M' (3 significant digits)."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}" if isinstance(n, float) and not float(n).is_integer() else str(int(n))


def duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


class Progress:
    """A progress bar with rate and ETA (see the module docstring). `total` may be None (unknown)."""

    def __init__(self, description: str, total: float | None = None, unit: str = "items",
                 stream: TextIO | None = None, interval: float = 10.0, enabled: bool = True, delay: float = 0.0):
        self.description, self.total, self.unit = description, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.1 if self.tty else interval
        self.enabled = enabled
        self.delay = delay
        """Work finished within `delay` seconds shows nothing at all (no bar, no final line)."""
        self.postfix = ""
        """Extra text shown after the numbers (e.g. a second rate); the caller updates it."""
        self.done = 0.0
        self.start = time.monotonic()
        # a terminal shows the bar at once; a log gets its first line after `interval` (a rate measured
        # over a few items would be noise), and short work only its final line
        self._last_draw = -float("inf") if self.tty else self.start
        self._drawn: float | None = None  # `done` at the last draw

    # ------------------------------------------------------------------ numbers
    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def rate(self) -> float:
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        if self.total is None or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / self.rate)

    def line(self) -> str:
        """The current state as text (without the bar)."""
        parts = [f"{human(self.done)}" + (f"/{human(self.total)}" if self.total is not None else "") + f" {self.unit}"]
        if self.total:
            parts.append(f"{100 * self.done / self.total:.1f}%")
        parts.append(f"{human(self.rate)} {self.unit}/s")
        eta = self.eta
        parts.append(f"ETA {duration(eta)}" if eta is not None else f"elapsed {duration(self.elapsed)}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    # ------------------------------------------------------------------ drawing
    def update(self, n: float = 1, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (force or now - self._last_draw >= self.interval) and now - self.start >= self.delay:
            self._last_draw = now
            self._draw()

    def _draw(self) -> None:
        self._drawn = self.done
        if self.tty:
            frac = min(1.0, self.done / self.total) if self.total else 0.0
            bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac)) if self.total else ""
            text = f"\r{self.description}  " + (f"[{bar}]  " if bar else "") + self.line().replace(", ", "  ")
            self.stream.write(text + "\033[K")
        else:
            self.stream.write(f"{self.description}: {self.line()}\n")
        self.stream.flush()

    def close(self, summary: str | None = None) -> None:
        """Final state (always printed), then `summary` if given."""
        if not self.enabled or (self.delay and self._drawn is None):
            self.enabled = False
            return
        if self._drawn != self.done or self.tty:
            self._draw()
        if self.tty:
            self.stream.write("\n")
        if summary:
            self.stream.write(summary + "\n")
        self.stream.flush()
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
