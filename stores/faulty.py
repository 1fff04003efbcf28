"""Fault injection: a store wrapper that fails, stalls, tears, corrupts and loses objects.

:class:`FaultyStore` wraps any :class:`~hylinker.stores.base.Store` and injects, driven by a
:class:`FaultPlan` and a seed (same plan, same seed, same call sequence: same faults):

* **failed keys** (``fail``): a key of a put/get answers :attr:`Outcome.FAILED` without
  reaching the inner store; ``exists`` answers False for it.
* **unavailable calls** (``unavailable``): the call raises :class:`StoreUnavailableError`.
* **scheduled failures** (``fail_calls`` ranges of call numbers, ``fail_every`` k-th call):
  the whole call fails the way ``scheduled`` says (``failed`` outcomes, ``unavailable``
  exception, or ``timeout``). Calls are numbered from 1 in arrival order; every data call
  (exists, put, get, touch, remove) counts.
* **latency** (``latency_ms`` plus uniform ``jitter_ms``) before every call.
* **timeouts**: with ``deadline_ms`` set, a call (latency included) that runs past the
  deadline answers :attr:`Outcome.UNREACHABLE` for its keys. ``timeout`` is the probability
  that a call is made to overrun: it waits out the deadline and answers UNREACHABLE. An
  overrun put still lands in the inner store (a timeout is ambiguous, as in real life); an
  overrun get writes nothing the caller may use.
* **torn writes** (``torn``): a put stores only a prefix of the object (a view of the
  caller's buffer, so zero-copy inners still see registered memory).
* **corruption** (``corrupt``): one byte is flipped in what a put stores (in the caller's
  buffer for the duration of the inner call, then restored) or in what a get returns. The byte
  is one that framing verifies (magic, version, flags, layout, key digest, length, checksum
  or payload) — the header's reserved bytes carry no data and are never picked.
* **a corrupt first read** (``corrupt_first_read``, not part of ``uniform``): the first get
  of an object (since it was put) returns it with one verified byte flipped, as a transfer
  fault would; the object in the store is intact and every later get returns it whole.
* **vanishing objects** (``vanish``): a key that ``exists`` reports present is gone by the
  next get (removed from the inner store where it can remove, and masked in any case until
  the key is put again).

Every fault reached is counted in :meth:`FaultyStore.statistics`, a :class:`FaultStatistics`
(a :class:`StoreStatistics` holding the inner store's counters plus the fault counters). With
every rate 0 and no schedule the wrapper is transparent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from .base import (
    GetResult,
    Outcome,
    Store,
    StoreCapabilities,
    StoreError,
    StoreStatistics,
    StoreUnavailableError,
    check_buffers,
    supports_checksums,
    supports_rows,
    supports_scatter,
)
from .calls import InflightCalls, check_keys
from .condemned import Condemned, ConditionalRemoveStore, compare_then_remove
from .fault_draws import VERIFIED_HEADER, FaultDraws, landed_checksum, locate, prefix
from .fault_plan import FaultPlan, FaultStatistics
from .frame_copies import check_parts, check_sealed
from .framing import HEADER_BYTES
from .rows import (
    CODE,
    OUTCOMES,
    RowBatch,
    RowResults,
    check_batch,
    headers,
    object_buffers,
    payload_sums,
)


class FaultyStore:
    """Wraps ``inner`` and injects the faults of ``plan``, deterministically from ``seed``.

    Closing the wrapper closes the inner store.
    """

    def __init__(self, inner: Store, plan: FaultPlan | None = None, seed: int = 0) -> None:
        if not isinstance(inner, Store):
            raise TypeError(f"inner must implement the Store protocol, got {type(inner).__name__}")
        self._inner = inner
        self._draws = FaultDraws(plan if plan is not None else FaultPlan(), seed)
        self._vanished: set[str] = set()  # grows only under a vanish fault (a test plan): put again, forgotten
        #: keys read since their last put; kept only under a corrupt_first_read plan (else every
        #: key ever read stayed here: issue 53)
        self._read: set[str] = set()
        inner_caps = inner.capabilities
        # scatter-gather and checksumming calls only where the inner store has them
        self._capabilities = attrs.evolve(inner_caps, name=f"faulty({inner_caps.name})",
                                          scatter=supports_scatter(inner), checksums=supports_checksums(inner),
                                          rows=supports_rows(inner))
        self._calls = InflightCalls(self._capabilities.name)

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def plan(self) -> FaultPlan:
        return self._draws.plan

    def replan(self, plan: FaultPlan) -> None:
        """Inject ``plan`` from the next call on (a soak's store outage, then its usual faults)."""
        self._draws.plan = plan

    @property
    def _plan(self) -> FaultPlan:
        """The plan in force (the name the reliability tests set it by: :meth:`replan`)."""
        return self._draws.plan

    @_plan.setter
    def _plan(self, plan: FaultPlan) -> None:
        self.replan(plan)

    # ---- protocol -------------------------------------------------------------------------

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    def register(self, region: torch.Tensor) -> None:
        self._inner.register(region)

    def unregister(self, region: torch.Tensor) -> None:
        self._inner.unregister(region)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [o is Outcome.OK for o in await self.exists_outcomes(keys)]

    async def exists_outcomes(self, keys: Sequence[str]) -> list[Outcome]:
        """``exists`` per key: OK present, MISSING absent, FAILED / UNREACHABLE for an injected
        failure (plain ``exists`` reports those as absent)."""
        check_keys(keys)
        with self._calls:
            scheduled = self._draws.begin_call()
            if scheduled == "timeout":
                await self._draws.overrun()
                return [Outcome.UNREACHABLE] * len(keys)
            if scheduled == "failed":
                return [Outcome.FAILED] * len(keys)
            failed = self._draws.draw_keys(len(keys), self._draws.plan.fail, "failed_keys")
            present = [Outcome.FAILED if failed[i] else Outcome.MISSING for i in range(len(keys))]
            ask = [i for i in range(len(keys)) if not failed[i] and keys[i] not in self._vanished]
            answer = await self._draws.within_deadline(
                lambda: self._inner.exists([keys[i] for i in ask])
            )
            if answer is None:
                for i in ask:
                    present[i] = Outcome.UNREACHABLE
                return present
            gone: list[str] = []
            for i, here in zip(ask, answer, strict=True):
                if here and self._draws.plan.vanish and self._draws.rng.random() < self._draws.plan.vanish:
                    gone.append(keys[i])
                present[i] = Outcome.OK if here else Outcome.MISSING
            if gone:
                await self._vanish(gone)
            return present

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        check_buffers(keys, buffers)
        return await self._put_objects(keys, [[b] for b in buffers], False,
                                       lambda ks, objs: self._inner.put(ks, [o[0] for o in objs]))

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        check_buffers(keys, buffers)
        return await self._get_objects(keys, [[b] for b in buffers],
                                       lambda ks, objs: self._inner.get(ks, [o[0] for o in objs]))

    # scatter-gather and checksumming calls: the same faults, on objects made of several
    # buffers (declared only where the inner store has them, see ``_parts_call``)

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        check_parts(keys, parts)
        return await self._put_objects(keys, parts, False, self._parts_call("put_parts"))

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        check_parts(keys, parts)
        return await self._get_objects(keys, parts, self._parts_call("get_parts"))

    async def put_sealed(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        """A corrupted sealed put flips a header byte (never the checksum field, which the
        inner store writes): a payload byte flipped before the store checksums what landed
        would be sealed as good, which no transfer fault does."""
        check_sealed(keys, parts)
        return await self._put_objects(keys, parts, True, self._parts_call("put_sealed"))

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        """A corrupted read flips a landed byte and reports the checksum of the bytes as they
        now are: the damage happened in transfer, before the store hashed what landed (as a
        real one would), so the caller's comparison with the header catches it."""
        check_sealed(keys, parts)
        return await self._get_objects(keys, parts, self._parts_call("get_checked"), rehash=True)

    async def put_rows(self, batch: RowBatch, hashed: bool) -> np.ndarray:
        """The faults of :meth:`put_parts` on a row-described sub-batch. A plan that tears or
        corrupts puts moves every object through the inner store's parts calls (a row
        description cannot carry a torn or flipped object); otherwise one ``put_rows`` of the
        objects that were not failed."""
        check_batch(batch)
        damaging = bool(self._draws.plan.torn or self._draws.plan.corrupt)
        # an inner store that does not checksum (Mooncake): the damaged objects are sealed here,
        # from the rows before the damage, and go through put_parts
        own_sums = damaging and hashed and not supports_checksums(self._inner)
        objects = _row_objects(batch, checksum_unset=True, sums=payload_sums(batch) if own_sums else None)
        where = {id(o): i for i, o in enumerate(objects)}
        inner_rows = self._parts_call("put_rows")

        async def send(keys: list[str], objs: list[Sequence[torch.Tensor]]) -> list[Outcome]:
            if damaging:
                return list(await self._parts_call("put_sealed" if hashed and not own_sums else "put_parts")(keys, objs))
            idx = [where[id(o)] for o in objs]
            codes = await inner_rows(batch.select(idx), hashed)
            return [OUTCOMES[c] for c in codes.tolist()]

        outcomes = await self._put_objects(batch.keys, objects, hashed and not own_sums, send)
        return np.asarray([CODE[o] for o in outcomes], dtype=np.int8)

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        """The faults of :meth:`get_checked` on a row-described sub-batch: one ``get_rows`` of
        the objects not failed or vanished; a damaged object's checksum is of its damaged rows."""
        check_batch(batch, get=True)
        objects = _row_objects(batch, checksum_unset=False)
        where = {id(o): i for i, o in enumerate(objects)}
        inner_rows = self._parts_call("get_rows")

        async def send(keys: list[str], objs: list[Sequence[torch.Tensor]]) -> list[GetResult]:
            idx = [where[id(o)] for o in objs]
            sub = batch.select(idx)  # its heads are a copy: the landed headers are copied back
            got = await inner_rows(sub, hashed)
            assert batch.heads is not None and sub.heads is not None
            batch.heads[idx] = sub.heads
            return [GetResult(OUTCOMES[c], int(b), int(x) if hashed else None)
                    for c, b, x in zip(got.codes.tolist(), got.nbytes.tolist(), got.checksums.tolist())]

        results = await self._get_objects(batch.keys, objects, send, rehash=hashed)
        out = RowResults.of(len(results), Outcome.FAILED)
        out.codes[:] = [CODE[r.outcome] for r in results]
        out.nbytes[:] = [r.nbytes for r in results]
        out.checksums[:] = [r.checksum or 0 for r in results]
        return out

    def _parts_call(self, name: str) -> Any:
        """The inner store's method ``name`` (the wrapper declares it only where it exists)."""
        method = getattr(self._inner, name, None)
        if method is None:
            raise TypeError(f"{self._inner.capabilities.name} has no {name}")
        return method

    async def _put_objects(self, keys: Sequence[str], objects: Sequence[Sequence[torch.Tensor]], sealed: bool,
                           send_to: Callable[[list[str], list[Sequence[torch.Tensor]]], Awaitable[list[Outcome]]],
                           ) -> list[Outcome]:
        """Every put: object ``i`` is the concatenation of ``objects[i]``; ``sealed``: its
        first part is a header whose checksum field the inner store fills."""
        with self._calls:
            scheduled = self._draws.begin_call()
            if scheduled == "failed":
                return [Outcome.FAILED] * len(keys)
            if scheduled == "timeout":
                await send_to(list(keys), list(objects))  # it lands; the caller never hears
                await self._draws.overrun()
                return [Outcome.UNREACHABLE] * len(keys)
            plan = self._draws.plan
            outcomes = [Outcome.FAILED] * len(keys)
            failed = self._draws.draw_keys(len(keys), plan.fail, "failed_keys")
            send = [i for i in range(len(keys)) if not failed[i]]
            sent: list[Sequence[torch.Tensor]] = []
            flips: list[tuple[torch.Tensor, int, int]] = []  # (buffer, position, old byte)
            for i in send:
                obj = objects[i]
                n = sum(p.numel() for p in obj)
                if plan.torn and n > 0 and self._draws.rng.random() < plan.torn:
                    # a sealed object keeps its whole header (the store needs one to seal)
                    n = self._draws.rng.randrange(HEADER_BYTES, n) if sealed and n > HEADER_BYTES else self._draws.rng.randrange(0, n)
                    obj = prefix(obj, n)
                    self._draws.counts["torn_writes"] += 1
                if plan.corrupt and n > 0 and self._draws.rng.random() < plan.corrupt:
                    pos = (self._draws.rng.choice([p for p in VERIFIED_HEADER if p < min(n, 40)] or [0]) if sealed
                           else self._draws.corrupt_position(n))
                    buf, local = locate(obj, pos)
                    flips.append((buf, local, int(buf[local])))
                    self._draws.counts["corrupted_writes"] += 1
                sent.append(obj)
            for buf, pos, old in flips:
                buf[pos] = old ^ self._draws.flip_mask()
            try:
                answer = await self._draws.within_deadline(lambda: send_to([keys[i] for i in send], sent))
            finally:
                for buf, pos, old in reversed(flips):
                    buf[pos] = old
            for j, i in enumerate(send):
                if answer is None:
                    outcomes[i] = Outcome.UNREACHABLE
                    continue
                outcomes[i] = answer[j]
                if answer[j] is Outcome.OK:
                    self._read.discard(keys[i])
                if keys[i] in self._vanished:
                    # Stored again from the caller's view (the inner may still hold it).
                    self._vanished.discard(keys[i])
                    if answer[j] is Outcome.EXISTS:
                        outcomes[i] = Outcome.OK
            return outcomes

    async def _get_objects(self, keys: Sequence[str], objects: Sequence[Sequence[torch.Tensor]],
                           send_to: Callable[[list[str], list[Sequence[torch.Tensor]]], Awaitable[list[GetResult]]],
                           rehash: bool = False) -> list[GetResult]:
        """Every get: object ``i`` is read into the concatenation of ``objects[i]``;
        ``rehash``: a damaged object's result carries the checksum of its damaged payload
        (``objects[i][1:]``), as a checksumming store's would."""
        with self._calls:
            scheduled = self._draws.begin_call()
            if scheduled == "failed":
                return [GetResult(Outcome.FAILED)] * len(keys)
            if scheduled == "timeout":
                await self._draws.overrun()
                return [GetResult(Outcome.UNREACHABLE)] * len(keys)
            plan = self._draws.plan
            results = [GetResult(Outcome.FAILED)] * len(keys)
            failed = self._draws.draw_keys(len(keys), plan.fail, "failed_keys")
            send: list[int] = []
            for i, key in enumerate(keys):
                if failed[i]:
                    continue
                if key in self._vanished:
                    results[i] = GetResult(Outcome.MISSING)
                    continue
                send.append(i)
            answer = await self._draws.within_deadline(
                lambda: send_to([keys[i] for i in send], [objects[i] for i in send])
            )
            for j, i in enumerate(send):
                if answer is None:
                    results[i] = GetResult(Outcome.UNREACHABLE)
                    continue
                result = answer[j]
                results[i] = result
                if (
                    result.outcome is Outcome.OK
                    and result.nbytes > 0
                    and plan.corrupt
                    and self._draws.rng.random() < plan.corrupt
                ):
                    self._draws.flip(objects[i], result.nbytes, "corrupted_reads")
                    damaged = True
                elif (plan.corrupt_first_read and result.outcome is Outcome.OK and result.nbytes > 0
                      and keys[i] not in self._read):
                    self._read.add(keys[i])
                    damaged = bool(plan.corrupt_first_read and self._draws.rng.random() < plan.corrupt_first_read)
                    if damaged:
                        self._draws.flip(objects[i], result.nbytes, "corrupted_first_reads")
                else:
                    damaged = False
                if damaged and rehash and result.checksum is not None:
                    results[i] = attrs.evolve(result, checksum=landed_checksum(objects[i][1:],
                                                                                result.nbytes - HEADER_BYTES))
            return results

    async def touch(self, keys: Sequence[str]) -> None:
        check_keys(keys)
        with self._calls:
            scheduled = self._draws.begin_call()
            if scheduled == "timeout":
                await self._draws.overrun()
                return
            if scheduled == "failed":
                return
            await self._draws.within_deadline(
                lambda: self._inner.touch([k for k in keys if k not in self._vanished])
            )

    async def remove(self, keys: Sequence[str]) -> int:
        return await self._remove_where(keys, None)

    async def remove_if(self, keys: Sequence[str], condemned: Sequence[Condemned]) -> int:
        """The inner store's atomic ``remove_if`` (faults as for ``remove``), where it has one;
        otherwise read, compare and remove through this wrapper (``stores/condemned.py``)."""
        if not isinstance(self._inner, ConditionalRemoveStore):
            return await compare_then_remove(self, keys, condemned)
        return await self._remove_where(keys, list(condemned))

    async def _remove_where(self, keys: Sequence[str], condemned: list[Condemned] | None) -> int:
        check_keys(keys)
        with self._calls:
            scheduled = self._draws.begin_call()
            if scheduled is not None:
                if scheduled == "timeout":
                    await self._draws.overrun()
                raise StoreUnavailableError(f"injected {scheduled} failure of remove")
            masked = {k for k in keys if k in self._vanished}
            self._vanished.difference_update(masked)
            kept = [i for i, k in enumerate(keys) if k not in masked]
            inner = self._inner
            answer = await self._draws.within_deadline(
                (lambda: inner.remove([keys[i] for i in kept])) if condemned is None else
                (lambda: inner.remove_if([keys[i] for i in kept],  # type: ignore[attr-defined]
                                         [condemned[i] for i in kept]))
            )
            if answer is None:
                raise StoreUnavailableError("remove ran past the fault plan's deadline")
            return answer

    def statistics(self) -> FaultStatistics:
        inner = attrs.asdict(self._inner.statistics(), recurse=False)
        base_names = {f.name for f in attrs.fields(StoreStatistics)}
        fields = {name: value for name, value in inner.items() if name in base_names}
        return FaultStatistics(**fields, **self._draws.counts)

    async def close(self) -> None:
        await self._calls.close()
        await self._inner.close()

    async def _vanish(self, keys: list[str]) -> None:
        self._draws.counts["vanished"] += len(keys)
        self._vanished.update(keys)
        if self._inner.capabilities.remove:
            with contextlib.suppress(StoreError):  # the mask hides them anyway
                await self._inner.remove(keys)


def _row_objects(batch: RowBatch, checksum_unset: bool,
                 sums: Sequence[int] | None = None) -> list[Sequence[torch.Tensor]]:
    """Each object of a row-described batch as buffers: its header (the batch's landing row for
    a get, a fresh one for a put, with ``sums`` as its checksums when given) and a view of each
    segment's rows."""
    heads = (batch.heads if batch.heads is not None and not checksum_unset
             else headers(batch, sums if sums is not None else [0] * len(batch.keys)))
    return list(object_buffers(batch, heads))
