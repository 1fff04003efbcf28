"""The store-latency monitor every pool actor's store calls feed and the backpressure reads."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LatencyMonitor:
    """EMA of store-call latency with a high/low watermark (hysteresis).

    While dropping, no offloads reach the store, so the EMA also decays with wall time
    (half-life ``decay_half_life_s``) to let the state end even without new samples.
    """

    def __init__(self, high_ms: float, low_ms: float, alpha: float = 0.2,
                 decay_half_life_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < low_ms <= high_ms:
            raise ValueError(f"need 0 < low_ms <= high_ms, got low={low_ms} high={high_ms}")
        self.high_ms, self.low_ms, self.alpha = high_ms, low_ms, alpha
        self.half_life = decay_half_life_s
        self.clock = clock
        self._ema_ms = 0.0
        self._stamp = clock()
        self.dropping = False

    def observe(self, seconds: float) -> None:
        self._decay()
        self._ema_ms += self.alpha * (seconds * 1e3 - self._ema_ms)
        self._update()

    @property
    def ema_ms(self) -> float:
        self._decay()
        return self._ema_ms

    def should_drop(self) -> bool:
        self._decay()
        self._update()
        return self.dropping

    def _decay(self) -> None:
        now = self.clock()
        dt = now - self._stamp
        self._stamp = now
        if dt > 0 and self.dropping:
            self._ema_ms *= math.pow(0.5, dt / self.half_life)

    def _update(self) -> None:
        if not self.dropping and self._ema_ms > self.high_ms:
            self.dropping = True
        elif self.dropping and self._ema_ms < self.low_ms:
            self.dropping = False
