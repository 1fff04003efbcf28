"""Counting the native threads a call starts: an OpenMP team is threads that Python does not know
(``stores/host_bytes.py``), so the checks count the process's tasks in ``/proc``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any


def tasks() -> set[int]:
    """The native ids of this process's threads."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def threads_started_by(fn: Callable[[], Any]) -> int:
    """Native threads that ``fn``, run on a fresh thread, started and left running."""
    before = tasks()
    ran, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        ran.set()
        done.wait(10)

    t = threading.Thread(target=body, name="host-bytes-check")
    t.start()
    try:
        assert ran.wait(10)
        started = tasks() - before - {t.native_id}
    finally:
        done.set()
        t.join()
    if errors:
        raise errors[0]
    return len(started)
