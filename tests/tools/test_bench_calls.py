"""The Python-call counter behind ``hylinker bench --only calls`` counts every thread's calls."""

from __future__ import annotations

import threading

from hylinker.tools.bench.calls import SHAPES, CallCounter, python_calls


def _leaf() -> int:
    return 1


def test_the_counter_sees_calls_in_threads_started_after_it_and_only_while_on() -> None:
    counter = CallCounter()
    threading.setprofile(counter)
    try:
        def work() -> None:
            for _ in range(100):
                _leaf()

        def run_thread() -> None:
            t = threading.Thread(target=work)
            t.start()
            t.join()

        py, _ = counter.measure(run_thread)
        assert py >= 100  # the worker thread's 100 calls were counted
        work()  # off: not counted
        assert counter.calls == py
    finally:
        threading.setprofile(None)


def test_python_calls_measures_every_shape_and_restores_the_bytes() -> None:
    row = python_calls(next(iter(SHAPES)), n=4)  # asserts the load restored the offloaded rows
    assert row["segments"] == 4
    for name in ("offload", "load", "verify_all_load"):
        total = row[f"{name}_py_calls_per_object"] + row[f"{name}_c_calls_per_object"]
        assert abs(row[f"{name}_calls_per_object"] - total) <= 0.2
        assert row[f"{name}_py_calls_per_object"] > 0 and row[f"{name}_c_calls_per_object"] > 0
