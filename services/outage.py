"""When a failing server (a retriever, an engine server) may be tried again: one rule for every client that
spreads requests over several servers."""

from __future__ import annotations

import time
from typing import Protocol


class Tracked(Protocol):
    """What the rule reads and writes on a server's record."""

    last_error: str
    failures: int  # > 0: down
    down_until: float  # time.monotonic() when a probe may bring it back


def mark_down(target: Tracked, reason: str, down_s: float) -> bool:
    """Out for `down_s`, doubled (up to 8x) each time it fails again after its time was up; requests that were in
    flight when it went down do not extend it (returns False then). Records `reason` either way."""
    target.last_error = reason
    now = time.monotonic()
    if target.failures and target.down_until > now:
        return False
    target.failures += 1
    target.down_until = now + down_s * min(2 ** (target.failures - 1), 8)
    return True
