"""The vLLM tools run as written: ``profile_vllm_restore`` times every part it names during a
real restore (a renamed hook in the connector or in vLLM would leave its part empty);
``python -m hylinker.tools.lab.vllm_keys`` times every keying variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_restore_profile_times_every_part_of_a_real_restore(tmp_path: Path) -> None:
    from hylinker.tools.lab.profile_vllm_restore import PARTS

    out = tmp_path / "profile.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    run = subprocess.run([sys.executable, "-m", "hylinker.tools.lab.profile_vllm_restore", "--sizes", "1152",
                          "--repeats", "1", "--json", str(out)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    restore = data["sizes"]["1152"]["median_restore"]
    # the tiny model's grid is one 384-token block: everything below the last block restores
    assert restore["cached"] == 768
    timed = set(restore["parts"])
    # the parts every restore passes through (the save copy and worker reports need a save;
    # of the three store-get and verify variants the store's path picks one)
    for name in ("S lookup", "S   chained block keys", "S   index", "S load plan", "W submit load",
                 "W poll loads", "W   store get", "W   copy into pages", "V schedule", "V engine step",
                 "W load wall (submit to done)"):
        assert name in timed, (name, sorted(timed))
    assert timed <= {name for *_, name in PARTS} | {"W load wall (submit to done)"}
    assert data["host"]["memcpy_gbps"] > 0


def test_the_keys_benchmark_runs_and_times_every_variant(tmp_path: Path) -> None:
    from hylinker.tools.lab.vllm_keys import main

    out = tmp_path / "keys.json"
    assert main(["--tokens", "4096", "--blocks", "16", "--repeats", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"]["4096_tokens_block_16"]
    assert row["blocks"] == 256
    assert all(row[k] > 0 for k in ("plain_chain_ms", "plain_request_ms", "salt_and_image_ms"))
