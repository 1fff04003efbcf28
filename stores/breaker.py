"""The circuit breaker of the resilient store (``stores/resilient.py``): closed, open after
consecutive attempts with no answer, half open for one probe per interval."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive failed attempts; one probe per interval."""

    def __init__(self, threshold: int, probe_interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.interval = probe_interval_s
        self.clock = clock
        self.state = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.probing = False
        self.counts = {"breaker_trips": 0, "rejected_calls": 0, "probes": 0, "resumes": 0}

    def admit(self) -> bool:
        """Whether a call may reach the store now (a probe when the breaker is open)."""
        if self.state == "closed":
            return True
        if not self.probing and self.clock() - self.opened_at >= self.interval:
            self.probing = True
            self.state = "half_open"
            self.counts["probes"] += 1
            return True
        self.counts["rejected_calls"] += 1
        return False

    def probe_due(self) -> bool:
        """Whether the next call would be let through as a probe (read-only; ``admit`` decides)."""
        return self.state == "open" and not self.probing and self.clock() - self.opened_at >= self.interval

    def success(self) -> None:
        self.failures = 0
        if self.state != "closed":
            self.state = "closed"
            self.probing = False
            self.counts["resumes"] += 1

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open":
            self._open()
        elif self.state == "closed" and self.threshold and self.failures >= self.threshold:
            self.counts["breaker_trips"] += 1
            self._open()

    def abandon_probe(self) -> None:
        """A probe that ended without an answer either way (cancelled): let another try."""
        if self.state == "half_open":
            self._open()

    def _open(self) -> None:
        self.state = "open"
        self.probing = False
        self.opened_at = self.clock()
