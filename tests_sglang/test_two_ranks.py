"""Two real TP ranks (two processes, gloo on loopback) agree through SGLang's own MIN.

Each process runs ``hylinker.testing.sglang_ranks``: SGLang's ``UnifiedRadixCache`` with a gloo
TP group and the plugin on one shared Mooncake master. SGLang's scheduler path intersects the
ranks' restorable sets (``_sync_restorable_prefix``, a MIN all-reduce over the group) and
reduces load and offload results; the ranks lose different state objects, so their own answers
differ and only the common depth may be taken.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.mooncake
@pytest.mark.slow
@pytest.mark.parametrize("core", ["python", "rust"])
def test_two_ranks_take_the_same_hit_through_sglangs_min(mooncake_master: Any, tmp_path: Path, core: str) -> None:
    port = _free_port()
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "hylinker.testing.sglang_ranks", "--rank", str(rank), "--world", "2",
               "--port", str(port), "--master", mooncake_master.address, "--core", core,
               "--out", str(tmp_path / f"rank{rank}.json")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)  # the plugin read its rank from the group
    # MLA latent KV is one rank-replicated object (rank 0 writes it); states are per rank
    assert r0["kv_key"] == r1["kv_key"] and r0["state_key"] != r1["state_key"]
    assert r0["removed"] == r1["removed"] == 1
    # each rank alone: different sparse sets (a lost state each) ...
    assert r0["own_lookup"] == [24, 40] and r1["own_lookup"] == [24, 48]
    # ... SGLang's MIN keeps only the common depth, and both ranks restore it exactly
    for r in (r0, r1):
        s = r["served"]
        assert s["device_hit"] == 0 and s["store_hit"] == s["loaded"] == 24, r
        assert not s["aborted"] and s["restore_mismatches"] == [], r
        assert not r["again"]["aborted"] and r["again"]["restore_mismatches"] == [], r
        assert r["leaks"] == {"kv_rows": 0, "mamba_slots": 0, "req_slots": 0}, r
    assert r0["again"] == r1["again"]
    # rank 1 never writes the replicated KV; rank 0 does
    assert r1["stats"].get("objects_offloaded", 0) < r0["stats"]["objects_offloaded"]
