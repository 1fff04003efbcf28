"""What the resilient store tries and counts: its policy, its statistics, the outcomes worth
another try (the wrapper itself is ``stores/resilient.py``, its breaker ``stores/breaker.py``)."""

from __future__ import annotations

import attrs

from .base import Outcome
from .config_rules import non_negative, number_rule, positive


class NoAnswer:
    """An attempt that got no answer (timed out, raised, cancelled by shutdown)."""


NO_ANSWER = NoAnswer()

#: per-key outcomes worth another try: the store did not say anything about the object
TRANSIENT = frozenset({Outcome.FAILED, Outcome.UNREACHABLE, Outcome.LEASED})


_positive = positive()
_non_negative = non_negative()


@attrs.frozen
class ResiliencePolicy:
    """How hard to try, and when to stop trying. Every field has a production default."""

    #: tries per key per transfer (1: no retry)
    attempts: int = attrs.field(default=6, validator=_positive)
    #: backoff before a retry; doubles per retry while the store answers nothing, up to
    #: ``backoff_max_s`` (keys that failed in a call the store answered retry after
    #: ``backoff_s``); +- ``jitter`` share at random
    backoff_s: float = attrs.field(default=0.001, validator=_non_negative)
    backoff_max_s: float = attrs.field(default=0.1, validator=_non_negative)  # the longest backoff
    jitter: float = attrs.field(default=0.5, validator=number_rule(at_least=0, at_most=1))  # share of a backoff drawn at random, in [0, 1]
    #: one call to the inner store may take this long; past it its keys are UNREACHABLE
    call_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    #: one transfer (a wrapper call, all its attempts and backoffs) ends by this deadline
    deadline_s: float = attrs.field(default=10.0, validator=_positive)
    #: consecutive attempts with no answer that open the breaker (0: never open it)
    failure_threshold: int = attrs.field(default=5, validator=_non_negative)
    #: while open, let one call through as a probe this often
    probe_interval_s: float = attrs.field(default=0.5, validator=_positive)
    #: on shutdown, how long calls in flight may still run before they are cancelled
    close_grace_s: float = attrs.field(default=1.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.attempts, int) or not isinstance(self.failure_threshold, int):
            raise ValueError("ResiliencePolicy.attempts and failure_threshold are integers")


@attrs.frozen
class ResilienceStatistics:
    """What the wrapper did, as counts (a snapshot)."""

    calls: int  # wrapper calls (transfers)
    attempts: int  # calls that reached the inner store
    retries: int  # attempts beyond the first
    retried_keys: int  # key-attempts repeated after a transient outcome
    recovered_keys: int  # keys that succeeded on a retry
    exhausted_keys: int  # keys still transient after every attempt or past the deadline
    timeouts: int  # inner calls cut at call_timeout_s
    unavailable: int  # inner calls that raised StoreUnavailableError (or another StoreError)
    cancelled: int  # inner calls their caller cancelled before an answer (count toward the breaker)
    breaker_trips: int  # closed -> open
    rejected_calls: int  # answered by the open breaker without reaching the store
    probes: int  # calls let through while open
    resumes: int  # open -> closed after a probe answered
    cancelled_on_shutdown: int  # inner calls cancelled by shutdown after the grace period
    breaker: str  # "closed", "open" or "half_open" now
