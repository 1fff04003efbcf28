"""A transfer job and its results: what a pool actor's queues carry and what each job returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio
import attrs
import torch

from ...components.layout import PoolKind
from ...components.pool_view import PoolViewError
from ...stores.base import Outcome, bad_key
from ...stores.condemned import Condemned
from .events import DeviceEvent

if TYPE_CHECKING:
    from .in_place import RowTarget

T = TypeVar("T")


class Completion(Generic[T]):
    """A one-shot result slot that async code can await."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Completion[T]], None]] = []

    def set(self, value: T) -> None:
        """Set the result; the first ``set`` or ``fail`` wins, later ones are ignored."""
        if self._event.is_set():
            return
        self._value = value
        self._event.set()
        self._run_callbacks()

    def fail(self, error: BaseException) -> None:
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        self._run_callbacks()

    def add_callback(self, fn: Callable[[Completion[T]], None]) -> None:
        """Call ``fn(self)`` on the loop once the result is set (now, if it already is)."""
        if self._event.is_set():
            fn(self)
        else:
            self._callbacks.append(fn)

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def value(self) -> T | None:
        return self._value

    @property
    def done(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


STORED = (Outcome.OK, Outcome.EXISTS)  # the object is in the store either way


@attrs.frozen
class OffloadResult:
    outcomes: list[Outcome]

    @property
    def ok(self) -> bool:
        return all(o in STORED for o in self.outcomes)


@attrs.frozen
class LoadResult:
    ok: list[bool]  # object i landed and verified
    faults: dict[str, int]  # reason -> count for objects that did not

    @property
    def all_ok(self) -> bool:
        return all(self.ok)


CANCELLED = "cancelled"  # LoadResult fault: the job was cancelled before it started


@attrs.define(eq=False)
class TransferJob:
    keys: list[str]
    index: torch.Tensor  # [n, per]
    fence: DeviceEvent | None = None
    on_layer: Callable[[int], None] | None = None
    completion: Completion[object] = attrs.field(factory=Completion)
    request_id: str = ""
    group: int = 0  # which layer group's codec moves this job's objects
    started: bool = False  # a worker took it: it can no longer be cancelled
    cancelled: bool = False  # cancelled before it started: it ends without touching rows
    #: verify-all-then-land (a load): the worker gets and verifies into ``staged`` and writes
    #: no row; the load's ticket lands every job's ``staged`` once all of them verified
    hold: bool = False
    staged: torch.Tensor | None = None  # [n, stride] verified frames of a held load
    staged_in_arena: bool = False  # ``staged`` is the actor's registered held arena
    #: a held job got by row-described calls: its verified rows, laid out like the pool's
    #: segments inside ``staged`` (``in_place.private_rows``)
    staged_rows: RowTarget | None = None
    in_rows: bool = False  # a held job moved in place: its rows hold it, verified, not reported
    #: objects this load proved bad (verification failed after the re-read), by store key:
    #: what its reader may remove (``stores/condemned.py``)
    condemned: dict[str, Condemned] = attrs.field(factory=dict)
    #: a two-stage offload: set when its objects were copied out of its rows into sealed host
    #: frames (stage 1; ``runtime/dataplane/drain_route.py``): its rows may be reused from then on
    copied: Completion[object] = attrs.field(factory=Completion)
    #: a load: objects it copied from host-staging frames the store had not acknowledged yet
    #: (``runtime/dataplane/frame_restore.py``): landed, but not proof the store holds them
    from_staging: int = 0
    #: an offload: its sealed frames are in the staging index (restorable until the store
    #: answered: ``runtime/dataplane/frame_index.py``), so its rows and states are free at the copy
    in_frames: bool = False


def cancel_job(job: TransferJob) -> None:
    """End a load job that has not started: no row is touched, every object reads cancelled."""
    job.cancelled = True
    job.completion.set(LoadResult([False] * len(job.keys), {CANCELLED: len(job.keys)}))


def check_keys(keys: Sequence[str], pool: PoolKind) -> list[str]:
    """A transfer's keys as a list, or ``PoolViewError``: not one string, none empty, none repeated."""
    if isinstance(keys, (str, bytes)):
        raise PoolViewError(f"{pool.value}: keys must be a sequence of strings, not one {type(keys).__name__}")
    out = list(keys)
    bad, k = bad_key(out)
    if bad:
        raise PoolViewError(f"{pool.value}: store keys must be non-empty strings, got {k!r}")
    if len(set(out)) != len(out):
        raise PoolViewError(f"{pool.value}: repeated keys in one transfer")
    return out


def group_key(key: str, group: int, groups: int) -> str:
    """The store key of layer group ``group`` of an object (the key itself when ``groups == 1``)."""
    return key if groups == 1 else f"{key}|g{group}of{groups}"


def group_keys(keys: Sequence[str], group: int, groups: int) -> list[str]:
    """:func:`group_key` of every key (one comprehension, no call per key)."""
    return list(keys) if groups == 1 else [f"{key}|g{group}of{groups}" for key in keys]
