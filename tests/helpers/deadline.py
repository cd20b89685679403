"""A call that must finish in time: a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def within(fn: Callable[[], Any], deadline_s: float) -> Any:
    """``fn()`` in a daemon thread; its result, or what it raised; fails the test if it runs past
    ``deadline_s`` seconds."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    assert not t.is_alive(), f"still waiting after {deadline_s:.0f} s: the call hung"
    if "error" in out:
        raise out["error"]
    return out["value"]
