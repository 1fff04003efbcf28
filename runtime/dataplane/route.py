"""What a transfer route is: how a pool actor moves one job's objects, one object per route
(``staged_route.py``, ``in_place.py``, ``rows_route.py``, ``held_load.py``,
``device_transfers.py``), each built over the actor's
:class:`~hylinker.runtime.dataplane.staging_arena.StagingArena` and
:class:`~hylinker.runtime.dataplane.store_calls.StoreCalls`."""

from __future__ import annotations

from typing import Protocol

from .transfer_jobs import LoadResult, OffloadResult, TransferJob


class LoadRoute(Protocol):
    """Loads a job's objects into its rows (or, held, into private frames), verified."""

    async def load(self, job: TransferJob) -> LoadResult:
        """Every object of ``job``: read, verified, landed; one result per object."""

    async def reread(self, job: TransferJob, again: list[int], faults: dict[str, int]) -> list[bool]:
        """Read the objects ``again`` (indices into the job) once more and verify them as the
        first time; whether each is usable now. What fails now is counted under its fault in
        ``faults`` and, a damaged object, noted on ``job.condemned`` (the stored object is bad)."""


class TransferRoute(LoadRoute, Protocol):
    """A route that also offloads."""

    async def offload(self, job: TransferJob) -> OffloadResult:
        """Every object of ``job``: framed from its rows and put; one outcome per object."""

