"""Run one function on N real processes joined by a gloo process group on loopback.

Each process is one tensor-parallel rank: it initialises ``torch.distributed`` (gloo, TCP on
127.0.0.1), builds a :class:`~hylinker.runtime.linker.agreement.GlooAgreement` and runs
``target(rank, size, agreement, *args)`` — an async function — to completion. What each rank
returns (JSON-able) comes back to the caller, by rank. A rank that raises fails the launch with
its error. Used by ``hylinker stress --ranks N`` and the multi-rank tests.
"""

from __future__ import annotations

import datetime
import json
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from ..runtime.linker.agreement import GlooAgreement
from ..stores.mooncake_master import free_port

RankTarget = Callable[..., Awaitable[Any]]


class RankFailure(RuntimeError):
    """A rank process raised or died."""


def _rank_entry(rank: int, size: int, port: int, timeout_s: float, target: RankTarget,
                args: tuple[Any, ...], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share the host's cores: one intra-op thread each
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    agreement = GlooAgreement.create(timeout_s=timeout_s)
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        result = anyio.run(target, rank, size, agreement, *args)
        path.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException as exc:
        path.write_text(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()}))
        raise
    finally:
        agreement.close()
        dist.destroy_process_group()


def launch(size: int, target: RankTarget, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``target`` on ``size`` rank processes; their results, by rank.

    ``target`` and ``args`` must be picklable (a module-level function). ``timeout_s`` bounds
    every collective (a rank that stops answering fails its peers' rounds instead of hanging).
    """
    import torch.multiprocessing as mp

    if size < 1:
        raise ValueError(f"ranks must be >= 1, got {size}")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hylinker-ranks-") as out_dir:
        error: BaseException | None = None
        try:
            mp.spawn(_rank_entry, args=(size, port, timeout_s, target, args, out_dir), nprocs=size, join=True)
        except Exception as exc:  # a rank raised or died: report every rank's error below
            error = exc
        results: list[Any] = []
        failures: list[str] = []
        for rank in range(size):
            path = Path(out_dir) / f"rank{rank}.json"
            if not path.exists():
                failures.append(f"rank {rank}: no result (died)")
                continue
            got = json.loads(path.read_text())
            if got["ok"]:
                results.append(got["result"])
            else:
                failures.append(f"rank {rank}: {got['error']}\n{got['traceback']}")
        if failures or error is not None:
            raise RankFailure("\n".join(failures) or str(error))
        return results


__all__ = ["RankFailure", "RankTarget", "launch"]
