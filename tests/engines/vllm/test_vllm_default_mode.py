"""HylinkerConnector in vLLM's default process model: ``LLM(...)`` with no environment variable
set, so the scheduler-side connector (engine core) and the worker-side connector run in different
processes. The embedded store lives in the worker; the scheduler learns what it holds from the
worker's reports (``integrations/vllm/index.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_engine, worker_statistics
from test_vllm_connector import RESET, RESTORED, gen, same_output

pytestmark = pytest.mark.slow


def test_embedded_store_hits_after_reset_in_the_default_process_model(
        model_dir: Path, prompts: dict[str, list[int]], reference: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    short, long = prompts["short"], prompts["long"]
    log = tmp_path / "engine.log"
    r = run_engine(model_dir, {"store": "embedded"}, [gen(short), RESET, gen(short), RESET, gen(long)], log,
                   in_process=False)
    cold, warm, extended = r[0], r[2], r[4]
    assert cold["cached"] == 0
    same_output(cold, reference["short"])
    assert warm["cached"] == RESTORED  # vLLM's own cache was reset: the connector restored it
    same_output(warm, reference["short"])
    assert extended["cached"] == RESTORED
    same_output(extended, reference["long"])
    stats = worker_statistics(log)
    assert set(stats) == {0}, log.read_text()[-3000:]
    assert stats[0]["loads_ok"] == 2 and stats[0]["loads_failed"] == 0
