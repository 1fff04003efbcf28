"""Restores that pay for themselves: decline a store hit whose load would take longer than
recomputing its tokens.

Two rates decide it, both observed while serving:

* the **load bandwidth**, payload bytes per second of the loads that landed so far (an
  exponential average over loads, :class:`LoadBandwidth`, kept by the data plane). It folds the
  store's per-call latency into the rate: a slow store (``latency_ms`` fault plan, a far master)
  shows up as a low rate;
* the **prefill rate**, tokens per second of the engine's own forwards: given by the engine
  (``LinkerConfig.prefill_tokens_per_s``) or reported to the Linker as it runs
  (:meth:`~hylinker.runtime.linker.facade.Linker.observe_prefill`, the same average).

A load of ``B`` bytes for ``T`` tokens pays when ``B / bandwidth < margin x T / prefill rate``.
Until both rates are known every hit is taken (the first loads are what measures the
bandwidth). The check is off by default (``LinkerConfig.decline_slow_restores``).
"""

from __future__ import annotations

import threading


class Rate:
    """An exponential average of ``amount / seconds`` over observations."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.observed = 0
        self._rate: float | None = None
        self._lock = threading.Lock()

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        r = amount / seconds
        with self._lock:
            self._rate = r if self._rate is None else (1 - self.alpha) * self._rate + self.alpha * r
            self.observed += 1

    @property
    def per_s(self) -> float | None:
        """The averaged rate (None: nothing observed yet)."""
        return self._rate


class LoadBandwidth(Rate):
    """Payload bytes per second of the loads that landed (submission to last object landed)."""

    def seconds(self, nbytes: int) -> float | None:
        """Estimated time to load ``nbytes`` (None: no load observed yet)."""
        rate = self.per_s
        return None if rate is None else nbytes / rate


def restore_pays(nbytes: int, tokens: int, bandwidth: LoadBandwidth, prefill_tokens_per_s: float | None,
                 margin: float = 1.0) -> bool:
    """Whether loading ``nbytes`` for ``tokens`` is expected to beat recomputing them; True while
    either rate is unknown."""
    load_s = bandwidth.seconds(nbytes)
    if load_s is None or not prefill_tokens_per_s:
        return True
    return load_s < margin * tokens / prefill_tokens_per_s


__all__ = ["LoadBandwidth", "Rate", "restore_pays"]
