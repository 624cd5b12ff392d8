"""Console progress: a tqdm bar on a terminal, plain log lines in files and CI logs.

A bar redrawn with carriage returns turns a log file into one enormous line, so when the stream is
not a TTY we print one self-contained line every ``log_every`` updates or ``log_every_s`` seconds
(whichever comes first), plus a final line on close.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """Progress over ``total`` units (train steps, usually).

    ``update(n, **live_fields)`` advances by ``n`` and shows the latest fields (e.g.
    ``reward=0.42, tokens_per_s=1.2e4``) in the bar's postfix or the log line.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        stream: IO[str] | None = None,
        log_every: int = 10,
        log_every_s: float = 30.0,
        enabled: bool = True,
    ):
        self.total = total
        self.desc = desc
        self.n = 0
        self._stream = stream if stream is not None else sys.stdout
        self._log_every = max(1, log_every)
        self._log_every_s = log_every_s
        self._fields: dict[str, Any] = {}
        self._start = time.monotonic()
        self._last_line_at = self._start
        self._updates_since_line = 0
        self._enabled = enabled
        self._closed = False
        self._bar = None
        if enabled and self._is_tty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self._stream, dynamic_ncols=True)

    def _is_tty(self) -> bool:
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty and isatty())

    @property
    def uses_bar(self) -> bool:
        return self._bar is not None

    def update(self, n: int = 1, **live_fields: Any) -> None:
        if self._closed:
            raise RuntimeError(f"Progress({self.desc!r}) was updated after close()")
        self.n += n
        self._fields.update(live_fields)
        if not self._enabled:
            return
        if self._bar is not None:
            if live_fields:
                self._bar.set_postfix({k: _format_value(v) for k, v in self._fields.items()}, refresh=False)
            self._bar.update(n)
            return
        self._updates_since_line += 1
        now = time.monotonic()
        if self._updates_since_line >= self._log_every or now - self._last_line_at >= self._log_every_s:
            self._write_line(now)

    def _write_line(self, now: float) -> None:
        elapsed = now - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        fields = " ".join(f"{k}={_format_value(v)}" for k, v in self._fields.items())
        line = f"{self.desc}: {self.n}/{self.total} ({rate:.3g}/s, {elapsed:.1f}s)"
        self._stream.write(f"{line} {fields}".rstrip() + "\n")
        self._stream.flush()
        self._last_line_at = now
        self._updates_since_line = 0

    def write(self, text: str) -> None:
        """Print one line without breaking the bar (tqdm.write above it on a TTY)."""
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(text, file=self._stream)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._enabled and self._updates_since_line:
            self._write_line(time.monotonic())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
