"""What a miss pays in the step (issue 52, item 5; docs/figures/vllm-peers.md): a save copies its
pages into host staging in the step's own thread, through NumPy. torch's ``copy_`` of a page over
~32,768 bytes runs an OpenMP parallel region on the engine's team instead, whose barrier waits for
every team thread: on a loaded 2-core host a miss's 13 page copies took 62-73 ms that way, 0.2 ms
this way. A region on a fresh thread starts a team of its own, which the check counts."""

from __future__ import annotations

import time

import torch

from hylinker.integrations import store_host
from hylinker.integrations.vllm.config import VllmConnectorConfig
from hylinker.integrations.vllm.pages import PageTransfers, RawPages
from hylinker.integrations.vllm.plan import TransferPlan
from hylinker.testing.threads import threads_started_by

BLOCKS = 8
PAGE = 2 * 384 * 64 * 2  # one attention block of one layer: k, v x 384 tokens x 64 dims x bf16 (96 KiB)


def _pages() -> RawPages:
    raw = torch.randint(-100, 100, (BLOCKS * PAGE,), dtype=torch.int8)
    return RawPages({"model.layers.0.attn": raw.view(torch.bfloat16).view(BLOCKS, 2, 384, 64)}, BLOCKS)


def test_a_saves_copy_into_staging_runs_no_openmp_region() -> None:
    """The step's copy of a save's pages starts no OpenMP team on a thread that has none (torch's
    ``copy_`` of the same page does: the control) and stages the pages' bytes exactly."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)  # as vLLM's CPU build on a 2-core host, whatever this host has
    host = store_host.acquire(VllmConnectorConfig.from_extra_config({"capacity_mb": 8}))
    try:
        pages = _pages()
        pt = PageTransfers(host, pages, fingerprint=b"f" * 32, with_state=False, staging_bytes=4 * PAGE)
        try:
            _check_copy_and_save(pt, pages)
        finally:
            pt.close(10.0)
    finally:
        torch.set_num_threads(old)
        store_host.release(host)


def _check_copy_and_save(pt: PageTransfers, pages: RawPages) -> None:
    raw, staging = pages.raws[0], pt.staging[0]
    assert raw[3].numel() == PAGE > 32768
    pairs = [(staging[0], raw[3]), (staging[1], raw[5])]
    assert threads_started_by(lambda: staging[2].copy_(raw[6])) >= 1  # the control: torch's copy
    assert threads_started_by(lambda: pt._copy_out(pairs, [0, 1])) == 0
    assert torch.equal(staging[0], raw[3]) and torch.equal(staging[1], raw[5])
    # the save path takes that copy: its bytes reach the store and load back exactly
    pt.save([TransferPlan("r1", ("n3",), (3,), (), ())])
    assert pt.drain(30.0) and pt.statistics().saves_ok == 1
    pt.load(TransferPlan("r2", ("n3",), (7,), (), ()))
    deadline = time.monotonic() + 30.0
    ok: set[str] = set()
    while "r2" not in ok and time.monotonic() < deadline:
        ok = pt.finished_loads()[0]
        time.sleep(0.01)
    assert ok == {"r2"} and torch.equal(raw[7], raw[3])
