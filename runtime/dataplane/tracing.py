"""Structured tracing: silent by default, trace-level JSON lines with one switch.

hylinker never configures structlog globally (that belongs to the host application); it
keeps a private logger. :func:`enable_trace_logging` turns on one JSON line per phase event
(request id, phase, pool, node, pages, bytes, microseconds) on a stream of your choice, or in a
file (``path``: appended, line-buffered, nothing but JSON lines; ``stress --trace-file``, the
plugins' ``trace_file`` key). Each line carries ``t``, the wall clock in seconds; an event that
ends something (a pool actor's job, a store call) also carries ``us``, how long it took, so
``hylinker trace FILE`` (``tools/timeline.py``) draws it as a slice.

A trace never fails a request: a stream that raises (closed, a broken pipe, a full disk) turns
tracing off, with one line on the standard ``logging`` logger ``hylinker.runtime.dataplane.tracing``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog

log = logging.getLogger(__name__)
_state: dict[str, Any] = {"enabled": False, "logger": None, "file": None}
_PID = os.getpid()


def _wall_clock(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event["t"] = time.time()
    event["pid"] = _PID  # several processes may append to one file (an engine's scheduler and workers)
    return event


def enable_trace_logging(stream: TextIO | None = None, path: str | Path | None = None) -> None:
    """Emit every phase event as a JSON line on ``stream`` (stderr by default), or appended to
    the file at ``path`` (created with its folder; the file tracing opened before is closed).
    A file that cannot be opened raises ``OSError`` naming it."""
    out: TextIO = stream or sys.stderr
    opened: TextIO | None = None
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        opened = out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed by disable)
    disable_trace_logging()
    _state["file"] = opened
    _state["logger"] = structlog.wrap_logger(
        structlog.WriteLogger(out),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _wall_clock,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(0),
        context_class=dict,
    )
    _state["enabled"] = True


def disable_trace_logging() -> None:
    """Stop tracing; close the trace file, if tracing opened one."""
    _state["enabled"] = False
    _state["logger"] = None
    opened, _state["file"] = _state["file"], None
    if opened is not None:
        try:
            opened.close()
        except OSError as exc:
            log.warning("hylinker: closing the trace file failed (%r)", exc)


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
