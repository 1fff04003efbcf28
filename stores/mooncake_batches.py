"""The Mooncake adapter's worker-thread side: the client's batch calls, cut into ``max_batch`` keys,
over registered regions (raw pointers, zero-copy) or through a registered bounce buffer, and the
gate that stops calling a master whose port is closed. :class:`~hylinker.stores.mooncake.MooncakeStore`
runs every method here in a worker thread, counted for its close; nothing here is async."""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import GetResult, Outcome, StoreUnavailableError
from .mooncake_client import (
    LEASE_EXPIRED,
    RPC_FAIL,
    MooncakeConfig,
    get_outcome,
    put_outcome,
    split_address,
)
from .mooncake_master import port_accepts

log = logging.getLogger(__name__)


class MasterUnreachable(Exception):
    """The master's port is closed: answer without calling the client."""


class MooncakeBatches:
    """The batch calls on one client (see the module doc). ``client`` is set to None once the
    store closed it; the store calls nothing here after that."""

    def __init__(self, client: Any, config: MooncakeConfig) -> None:
        self.client = client
        self.config = config
        # registered regions, sorted by start and disjoint, with their starts (for bisect);
        # replaced whole, never edited, so a store thread reading it meets one consistent table
        self.table: tuple[list[int], list[tuple[int, int, torch.Tensor]]] = ([], [])
        self.bounce_lock = threading.Lock()
        self.bounce: torch.Tensor | None = None
        self.master = split_address(config.master_address)
        self.master_down = False

    def set_regions(self, regions: list[tuple[int, int, torch.Tensor]]) -> None:
        self.table = ([r[0] for r in regions], regions)

    def replica_endpoints(self, keys: list[str]) -> list[str | None]:
        self.gate()
        descs = self.client.batch_get_replica_desc(keys)
        out: list[str | None] = []
        for key in keys:
            endpoint = None
            for replica in descs.get(key, []) if isinstance(descs, dict) else []:
                if replica.is_memory_replica():
                    endpoint = str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
                    break
            out.append(endpoint)
        return out

    def gate(self) -> None:
        """Worker thread: after a -900, call the client only if the master port is open."""
        if not self.master_down or self.master is None:
            return
        if port_accepts(self.master[0], self.master[1], self.config.probe_timeout_s):
            self.master_down = False
            return
        raise MasterUnreachable

    def note(self, codes: Sequence[int]) -> None:
        if RPC_FAIL in codes and not self.master_down:
            log.warning("mooncake master %s unreachable (code -900)", self.config.master_address)
            self.master_down = True

    def chunks(self, n: int, buffers: int = 0) -> list[range]:
        """Client calls for ``n`` objects: ``max_batch`` keys each, and for a call that moves
        ``buffers`` buffers per object, at most ``transfer_queue // workers`` buffers."""
        step = self.config.max_batch
        if buffers:
            step = max(1, min(step, self.config.transfer_queue // self.config.workers // buffers))
        return [range(i, min(i + step, n)) for i in range(0, n, step)]

    def is_exist(self, keys: list[str]) -> list[int]:
        self.gate()
        codes: list[int] = []
        for chunk in self.chunks(len(keys)):
            codes.extend([int(c) for c in self.client.batch_is_exist([keys[i] for i in chunk])])
        self.note(codes)
        return codes

    def remove(self, keys: list[str]) -> list[int]:
        self.gate()
        codes: list[int] = []
        for chunk in self.chunks(len(keys)):
            part = [keys[i] for i in chunk]
            codes.extend(int(c) for c in self.client.batch_remove(part, self.config.force_remove))
        self.note(codes)
        return codes

    def in_region(self, buf: torch.Tensor) -> bool:
        return self.registered(buf.data_ptr(), buf.numel())

    def registered(self, start: int, nbytes: int) -> bool:
        """Whether ``[start, start + nbytes)`` lies inside one registered region (regions are
        disjoint and sorted: one bisect, not a scan, per buffer)."""
        starts, regions = self.table
        at = bisect.bisect(starts, start) - 1
        return at >= 0 and start + nbytes <= regions[at][1]

    def part_spans(self, indices: Sequence[int], parts: list[list[torch.Tensor]]
                    ) -> tuple[list[int], list[list[int]], list[list[int]], list[int]]:
        """Objects whose every part lies in a registered region (with their pointers and sizes,
        read once here for the client call), and the others."""
        direct: list[int] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        other: list[int] = []
        registered = self.registered
        for i in indices:
            pp = [p.data_ptr() for p in parts[i]]
            ss = [p.numel() for p in parts[i]]
            if all(registered(a, n) for a, n in zip(pp, ss)):
                direct.append(i)
                ptrs.append(pp)
                sizes.append(ss)
            else:
                other.append(i)
        return direct, ptrs, sizes, other

    def ensure_bounce(self, nbytes: int) -> torch.Tensor:
        """The bounce buffer, grown to ``nbytes`` (call with ``_bounce_lock`` held or at open)."""
        bounce = self.bounce
        if bounce is not None and bounce.numel() >= nbytes:
            return bounce
        size = max(self.config.bounce_bytes, 1 << math.ceil(math.log2(max(nbytes, 1))))
        fresh = torch.empty(size, dtype=torch.uint8)
        rc = self.client.register_buffer(fresh.data_ptr(), size)
        if rc != 0:
            raise StoreUnavailableError(f"cannot register a {size}-byte bounce buffer (code {rc})")
        if bounce is not None:
            self.client.unregister_buffer(bounce.data_ptr())
        self.bounce = fresh
        return fresh

    def bounce_groups(self, indices: list[int], buffers: list[torch.Tensor]) -> list[list[int]]:
        """Split out-of-region buffers into groups that fit the bounce buffer together."""
        groups: list[list[int]] = []
        current: list[int] = []
        used = 0
        capacity = self.bounce.numel() if self.bounce is not None else self.config.bounce_bytes
        for i in indices:
            size = _aligned(buffers[i].numel())
            if current and used + size > capacity:
                groups.append(current)
                current, used = [], 0
            current.append(i)
            used += size
        if current:
            groups.append(current)
        return groups

    def _absent(self, keys: list[str]) -> tuple[list[Outcome | None], list[int] | None]:
        """A put's outcomes so far and the objects still to write: with ``detect_exists``, the
        present keys read EXISTS and are not written (None: the master did not answer)."""
        outcomes: list[Outcome | None] = [None] * len(keys)
        if not self.config.detect_exists:
            return outcomes, list(range(len(keys)))
        present = self.is_exist(keys)
        if RPC_FAIL in present:
            return outcomes, None
        if 1 not in present:  # the common case: nothing stored yet
            return outcomes, list(range(len(keys)))
        exists = Outcome.EXISTS
        return [exists if code == 1 else None for code in present], [i for i, code in enumerate(present) if code != 1]

    def put(self, keys: list[str], buffers: list[torch.Tensor]) -> list[Outcome]:
        self.gate()
        outcomes, todo = self._absent(keys)
        if todo is None:
            return [Outcome.UNREACHABLE] * len(keys)
        inside = [self.in_region(buffers[i]) for i in todo]
        direct = [i for i, yes in zip(todo, inside) if yes]
        bounced = [i for i, yes in zip(todo, inside) if not yes]
        for chunk in self.chunks(len(direct), 1):
            idx = [direct[j] for j in chunk]
            codes = self.client.batch_put_from(
                [keys[i] for i in idx],
                [buffers[i].data_ptr() for i in idx],
                [buffers[i].numel() for i in idx],
            )
            self._record(outcomes, idx, codes, put_outcome)

        def put_bounced(idx: list[int]) -> None:
            ptrs = self._stage(idx, buffers, copy_in=True)
            codes = self.client.batch_put_from([keys[i] for i in idx], ptrs, [buffers[i].numel() for i in idx])
            self._record(outcomes, idx, codes, put_outcome)

        self._each_bounced(bounced, buffers, put_bounced)
        return [o if o is not None else Outcome.FAILED for o in outcomes]

    def get(self, keys: list[str], buffers: list[torch.Tensor]) -> list[GetResult]:
        self.gate()
        results: list[GetResult | None] = [None] * len(keys)
        inside = [self.in_region(b) for b in buffers]
        direct = [i for i, yes in enumerate(inside) if yes]
        bounced = [i for i, yes in enumerate(inside) if not yes]

        def read(idx: list[int], ptrs: list[int]) -> list[int]:
            args = ([keys[i] for i in idx], ptrs, [buffers[i].numel() for i in idx])
            return self._read(self.client.batch_get_into, idx, args, results)

        for chunk in self.chunks(len(direct), 1):
            idx = [direct[j] for j in chunk]
            read(idx, [buffers[i].data_ptr() for i in idx])

        def get_bounced(idx: list[int]) -> None:
            self._unstage(idx, buffers, read(idx, self._stage(idx, buffers, copy_in=False)))

        self._each_bounced(bounced, buffers, get_bounced)
        return [r if r is not None else GetResult(Outcome.FAILED) for r in results]

    def put_parts(self, keys: list[str], parts: list[list[torch.Tensor]]) -> list[Outcome]:
        self.gate()
        outcomes, todo = self._absent(keys)
        if todo is None:
            return [Outcome.UNREACHABLE] * len(keys)
        direct, ptrs, sizes, joined = self.part_spans(todo, parts)
        for chunk in self.chunks(len(direct), max(map(len, ptrs), default=1)):
            idx = [direct[j] for j in chunk]
            codes = self.client.batch_put_from_multi_buffers(
                [keys[i] for i in idx], ptrs[chunk.start:chunk.stop], sizes[chunk.start:chunk.stop])
            self._record(outcomes, idx, codes, put_outcome)
        if joined:  # not registered: one contiguous copy each, then the bounced path
            got = self.put([keys[i] for i in joined], [torch.cat([p.cpu() for p in parts[i]])
                                                                 for i in joined])
            for i, o in zip(joined, got):
                outcomes[i] = o
        return [o if o is not None else Outcome.FAILED for o in outcomes]

    def get_parts(self, keys: list[str], parts: list[list[torch.Tensor]]) -> list[GetResult]:
        self.gate()
        results: list[GetResult | None] = [None] * len(keys)
        direct, ptrs, sizes, joined = self.part_spans(range(len(keys)), parts)
        for chunk in self.chunks(len(direct), max(map(len, ptrs), default=1)):
            idx = [direct[j] for j in chunk]
            args = ([keys[i] for i in idx], ptrs[chunk.start:chunk.stop], sizes[chunk.start:chunk.stop])
            self._read(self.client.batch_get_into_multi_buffers, idx, args, results)
        if joined:  # not registered: read whole through the bounced path, then split
            whole = [torch.empty(sum(p.numel() for p in parts[i]), dtype=torch.uint8) for i in joined]
            got = self.get([keys[i] for i in joined], whole)
            for i, w, r in zip(joined, whole, got):
                results[i] = r
                if r.outcome is Outcome.OK:
                    off = 0
                    for p in parts[i]:
                        n = min(p.numel(), r.nbytes - off)
                        if n <= 0:
                            break
                        p[:n].copy_(w[off:off + n])
                        off += n
        return [r if r is not None else GetResult(Outcome.FAILED) for r in results]

    def _read(self, call: Callable[..., Sequence[int]], idx: list[int], args: tuple[list[Any], ...],
              results: list[GetResult | None]) -> list[int]:
        """One read ``call`` over ``args`` (lists, one item per object ``idx[j]``), the objects
        whose lease ran out mid-transfer read a second time (a fresh lease); their results
        recorded; the codes."""
        codes = [int(c) for c in call(*args)]
        retry = [j for j, code in enumerate(codes) if code == LEASE_EXPIRED]
        if retry:
            again = call(*([a[j] for j in retry] for a in args))
            for j, code in zip(retry, again):
                codes[j] = int(code)
        self.note(codes)
        for i, code in zip(idx, codes):
            outcome = get_outcome(code)
            results[i] = GetResult(outcome, code if outcome is Outcome.OK else 0)
        return codes

    def _each_bounced(self, bounced: list[int], buffers: list[torch.Tensor],
                      move: Callable[[list[int]], None]) -> None:
        """``move`` each chunk of the objects outside the registered regions through the bounce
        buffer, grown to the largest of them, under the bounce lock."""
        if not bounced:
            return
        with self.bounce_lock:
            self.ensure_bounce(max(_aligned(buffers[i].numel()) for i in bounced))
            for group in self.bounce_groups(bounced, buffers):
                for chunk in self.chunks(len(group), 1):
                    move([group[j] for j in chunk])

    def _stage(self, idx: list[int], buffers: list[torch.Tensor], *, copy_in: bool) -> list[int]:
        assert self.bounce is not None
        base = self.bounce.data_ptr()
        ptrs: list[int] = []
        offset = 0
        for i in idx:
            n = buffers[i].numel()
            if copy_in:
                self.bounce[offset : offset + n].copy_(buffers[i])
            ptrs.append(base + offset)
            offset += _aligned(n)
        return ptrs

    def _unstage(self, idx: list[int], buffers: list[torch.Tensor], codes: list[int]) -> None:
        assert self.bounce is not None
        offset = 0
        for i, code in zip(idx, codes):
            if code > 0:
                buffers[i][:code].copy_(self.bounce[offset : offset + code])
            offset += _aligned(buffers[i].numel())

    def _record(
        self,
        outcomes: list[Outcome | None],
        idx: list[int],
        codes: Sequence[int],
        mapping: Callable[[int], Outcome],
    ) -> None:
        ints = [int(c) for c in codes]
        self.note(ints)
        for i, code in zip(idx, ints):
            outcomes[i] = mapping(code)


def _aligned(n: int) -> int:
    return (n + 63) & ~63
