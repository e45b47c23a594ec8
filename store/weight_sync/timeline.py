"""Per-phase timestamps of one :meth:`WeightSync.pull <mooncake_store.WeightSync.pull>`.

``PullResult.timeline`` holds them; ``benchmarks/weight_sync_bench.py --hosts --verbose`` prints
them. Recording costs a list append per event (a few per bucket part), so it is always on.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple


class PullEvent(NamedTuple):
    """One event of a pull."""

    t_s: float  #: seconds since the pull began (``time.monotonic()``)
    phase: str  #: what happened (see :class:`PullTimeline`)
    detail: str  #: which bucket, part, source ...
    #: requests to the store master answered since the pull began (by any thread of the client)
    master_requests: int
    #: CPU seconds (user + system, every thread of the process) since the pull began
    cpu_s: float


class PullTimeline:
    """Collects a pull's events and its client's requests to the master.

    Phases: ``records`` (commit record and manifests read), ``role`` (relay position, sources),
    ``first_byte`` (the first read of bucket bytes begins), ``part`` (a relay part arrived: detail
    ``b<bucket>.p<part> from <source>``), ``bucket`` (a bucket's bytes are all here), ``staged`` (a
    bucket's pieces checked and copied), ``fetched`` (every bucket staged), ``installed``.
    """

    def __init__(self, link) -> None:
        self._link = link
        self._t0 = time.monotonic()
        self._cpu0 = time.process_time()
        self._lock = threading.Lock()
        self.events: list = []
        self.requests: list = []  # (sent_s, answered_s, method), seconds since the pull began
        self._trace: list = []
        self._first = False
        if getattr(link, "trace", False) is None:  # another pull's timeline owns it otherwise
            link.trace = self._trace

    def mark(self, phase: str, detail: str = "") -> None:
        """Records ``phase`` now."""
        with self._lock:
            self.events.append(
                PullEvent(
                    time.monotonic() - self._t0,
                    phase,
                    detail,
                    len(self._trace),
                    time.process_time() - self._cpu0,
                )
            )

    def first_byte(self, detail: str) -> None:
        """Records ``first_byte`` once: the first read of bucket bytes begins."""
        if not self._first:
            self._first = True
            self.mark("first_byte", detail)

    def close(self) -> tuple:
        """Stops tracing requests; returns the events, in time order."""
        if self._link.trace is self._trace:
            self._link.trace = None
        self.requests = [(a - self._t0, b - self._t0, m) for a, b, m in self._trace]
        return tuple(sorted(self.events))


def format_timeline(events, requests=()) -> list:
    """Lines describing a pull's ``events`` (``PullResult.timeline``) for a human."""
    lines = []
    first = next((e for e in events if e.phase == "first_byte"), None)
    if first is not None:
        before = [m for _, _, m in requests[: first.master_requests]]
        lines.append(
            f"first byte at {first.t_s * 1e3:.1f} ms after {first.master_requests} master requests"
            + (f" ({', '.join(before)})" if before else "")
        )
    for e in events:
        lines.append(
            f"{e.t_s * 1e3:9.1f} ms  {e.phase:<10} {e.detail}  (master requests "
            f"{e.master_requests}, CPU {e.cpu_s * 1e3:.0f} ms)"
        )
    if requests:
        per: dict = {}
        for a, b, m in requests:
            n, s, worst = per.get(m, (0, 0.0, 0.0))
            per[m] = (n + 1, s + (b - a), max(worst, b - a))
        lines.append(
            "master requests: "
            + ", ".join(
                f"{m} x{n} mean {s / n * 1e3:.1f} ms max {w * 1e3:.1f} ms"
                for m, (n, s, w) in sorted(per.items(), key=lambda kv: -kv[1][1])
            )
        )
    return lines
