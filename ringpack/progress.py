"""Progress of long work: a tqdm bar on a terminal, a few log lines elsewhere, nothing when disabled.

Work that can take more than a few seconds (planning an epoch, fingerprinting a dataset, writing
shards) counts itself in units a reader recognises: ``"steps"``, ``"micro-batches"``,
``"samples"``. On a terminal the count is a tqdm bar on stderr. When stderr is not a terminal (a
batch job's log, a pipe, a notebook cell's captured output) a bar would fill the log with carriage
returns, so the count goes to the ``ringpack.progress`` logger instead, at INFO, at most once every
:data:`LOG_INTERVAL_S` seconds and once more when such work ends: work that finishes sooner logs
nothing. Applications choose what they see through ``logging``; the ``ringpack`` command line
shows these lines on stderr (``--quiet`` turns progress off).

See docs/planner.md, "`ringpack plan`".
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["LOG_INTERVAL_S", "Progress", "clock"]

#: Least seconds between two progress log lines (when stderr is not a terminal).
LOG_INTERVAL_S = 10.0
logger = logging.getLogger("ringpack.progress")
#: The bar once its total is known: ``planning:  40%|####      | 39/98 steps [00:12<00:18]``.
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}]"


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def clock(seconds: float) -> str:
    """``75.2`` -> ``"1m15s"``; ``4.2`` -> ``"4s"``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Count work done towards a total, shown as a bar on a terminal or logged now and then.

    Args:
        desc: what the work is (``"planning"``, ``"writing shards"``).
        unit: what one count is, plural (``"steps"``, ``"micro-batches"``, ``"samples"``).
        total: counts when done; ``None`` while unknown (:meth:`advance_to` may give it later).
        enabled: ``False`` makes every method a no-op (``--quiet``).
        stream: where a bar is drawn (default ``sys.stderr`` when the bar starts); a bar only when
            it is a terminal, log lines otherwise.

    Use as a context manager, or call :meth:`close` when the work ends.
    """

    def __init__(
        self,
        desc: str,
        unit: str,
        total: int | None = None,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.desc, self.unit, self.total = desc, unit, total
        self.enabled = enabled
        self.done = 0
        self._start = self._last_log = time.monotonic()
        self._logged = False
        self._bar = None
        self._lock = threading.RLock()  # counted from several threads (shard files written in parallel)
        stream = stream if stream is not None else sys.stderr
        if enabled and _is_terminal(stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=f" {unit}",
                file=stream,
                dynamic_ncols=True,
                bar_format=_BAR_FORMAT if total is not None else None,
            )

    # ------------------------------------------------------------------------------- counting
    def update(self, n: int = 1) -> None:
        """``n`` more units done (safe from several threads)."""
        with self._lock:
            self.advance_to(self.done + n)

    def advance_to(self, done: int, total: int | None = None) -> None:
        """``done`` units of ``total`` (``None``: the total stays) are done."""
        if not self.enabled:
            return
        with self._lock:
            if total is not None and total != self.total:
                self.total = total
                if self._bar is not None:
                    self._bar.total, self._bar.bar_format = total, _BAR_FORMAT
            step, self.done = done - self.done, done
            if self._bar is not None:
                self._bar.update(step)
            elif time.monotonic() - self._last_log >= LOG_INTERVAL_S:
                self._log()

    def part(self, index: int, parts: int) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback for part ``index`` of ``parts`` equal parts of this work.

        For work repeated ``parts`` times (one plan per strategy): part ``k``'s ``done`` of
        ``total`` counts as ``k * total + done`` of ``parts * total``.
        """
        return lambda done, total: self.advance_to(index * total + done, parts * total)

    def set_description(self, desc: str) -> None:
        if not self.enabled:
            return
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description_str(desc)

    # ------------------------------------------------------------------------------ finishing
    def close(self) -> None:
        """End the bar; a last log line if this work logged any (so a log shows it finished)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._logged:
            self._log()
            self._logged = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._start
        if self.total:
            share = min(self.done / self.total, 1.0)
            left = f", about {clock(elapsed * (1 - share) / share)} left" if 0 < share < 1 else ""
            count = f"{self.done:,}/{self.total:,} {self.unit} ({share:.0%})"
        else:
            count, left = f"{self.done:,} {self.unit}", ""
        logger.info("%s: %s, %s%s", self.desc, count, clock(elapsed), left)
        self._last_log = now
        self._logged = True
