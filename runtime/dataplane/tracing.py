"""Structured tracing: silent by default, trace-level JSON lines with one switch.

hylinker never configures structlog globally (that belongs to the host application); it
keeps a private logger. :func:`enable_trace_logging` turns on one JSON line per phase event
(request id, phase, pool, node, pages, bytes, microseconds) on a stream of your choice.

A trace never fails a request: a stream that raises (closed, a broken pipe, a full disk) turns
tracing off, with one line on the standard ``logging`` logger ``hylinker.runtime.dataplane.tracing``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

log = logging.getLogger(__name__)
_state: dict[str, Any] = {"enabled": False, "logger": None}


def enable_trace_logging(stream: TextIO | None = None) -> None:
    """Emit every phase event as a JSON line on ``stream`` (stderr by default)."""
    _state["logger"] = structlog.wrap_logger(
        structlog.WriteLogger(stream or sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(0),
        context_class=dict,
    )
    _state["enabled"] = True


def disable_trace_logging() -> None:
    _state["enabled"] = False
    _state["logger"] = None


def trace_enabled() -> bool:
    return bool(_state["enabled"])


def _emit(level: str, event: str, fields: dict[str, Any]) -> None:
    fields.setdefault("phase", event.split(".", 1)[0])
    logger = _state["logger"]
    try:
        getattr(logger, level)(event, **fields)
    except Exception as exc:  # the stream failed: no more traces, one line, the caller goes on
        if _state["logger"] is logger:
            disable_trace_logging()
            log.warning("hylinker: the trace stream failed (%r); tracing is off", exc)


def trace(event: str, **fields: Any) -> None:
    """One trace event; costs one dict lookup when tracing is off."""
    if _state["enabled"]:
        _emit("debug", event, fields)


def warn(event: str, **fields: Any) -> None:
    """A degradation worth a line even when tracing is off is counted instead; traced when on."""
    if _state["enabled"]:
        _emit("warning", event, fields)
