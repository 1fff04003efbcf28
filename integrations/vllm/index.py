"""Where the vLLM connector's scheduler side learns which objects the store holds.

vLLM runs its scheduler (the engine core) and its workers in different processes by default, one
worker per tensor-parallel rank. Every rank saves and loads its own shard of each object under a
key that carries the rank (:func:`rank_key`); the scheduler plans with rank-free *names* and
offers a hit only when every rank holds every object it needs. Two ways to know that, one object
per kind of store (:class:`ObjectLookup`):

* :class:`StoreProbe` — a store every process can reach (Mooncake): ask it for every copy's key.
  There, attention pages that vLLM replicates over ranks (fewer KV heads than ranks, or an MLA
  latent cache: :func:`kv_replicas`) are written once, by the first rank of each group of
  replicas, and read by all of them (:class:`KeyLayout`).
* :class:`StoreIndex` — a store inside each worker (the embedded store): the scheduler keeps an
  index per rank, fed by :class:`RankReport` s that travel with vLLM's worker → scheduler
  connector output each step (objects stored, objects gone: a failed write, a skipped save, an
  eviction, a damaged object removed after a failed load). A save the scheduler has just planned
  counts as present on every rank until each rank reports its outcome (:meth:`StoreIndex.planned`);
  a worker that loads an object whose save is still in flight copies it from that save's staging
  slot (:meth:`~hylinker.integrations.vllm.pages.PageTransfers.load`). A save that was skipped
  (host staging full) or failed is reported dropped in the step's report, so the next lookup
  misses. A report
  from a new worker incarnation (a restarted worker) drops everything the index held for that
  rank and every planned save, so the index never claims an object of a worker that is gone.

An index entry can still be stale (an object evicted after the report that listed it, a report not
yet arrived): the load then finds the object missing or damaged, fails, and vLLM recomputes the
request; the worker reports the object gone. A stale entry costs a recompute, never a wrong
restore: every load is verified against the object's checksum and geometry fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from ...components.keys import RANK_MARK, rank_key
from ...components.ranks import writes
from ..store_host import StoreHost

BLOCK_MARK = ":kv:"  # in the names of attention blocks (plan.attention_key), not of states


def kv_replicas(total_kv_heads: int, tp: int, *, latent: bool = False) -> int:
    """How many consecutive tensor-parallel ranks hold identical attention pages, by vLLM's own
    sharding: with fewer KV heads than ranks each head lives on ``tp // heads`` ranks
    (``QKVParallelLinear.num_kv_head_replicas``, rank ``r`` loads head shard ``r // replicas``);
    an MLA latent cache (``latent``) is the same on every rank (``ModelConfig.get_num_kv_heads``
    answers 1 for MLA; ``kv_a_proj_with_mqa`` is a ``ReplicatedLinear``)."""
    if tp < 1 or total_kv_heads < 1:
        raise ValueError(f"tensor parallel size {tp} and KV heads {total_kv_heads} must be >= 1")
    if latent:
        return tp
    if total_kv_heads >= tp:
        return 1
    if tp % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads do not replicate evenly over {tp} ranks")
    return tp // total_kv_heads


@attrs.frozen
class CopyRanks:
    """How the ranks share one kind of object: ``replicas`` consecutive ranks hold identical
    pages; the first of them writes the one copy under its key and all of them read it."""

    ranks: int
    replicas: int = 1

    def __attrs_post_init__(self) -> None:
        if self.ranks < 1 or self.replicas < 1 or self.ranks % self.replicas:
            raise ValueError(f"{self.replicas} replicas do not divide {self.ranks} ranks")

    def owner(self, rank: int) -> int:
        """The rank whose key holds the copy ``rank`` reads."""
        return rank - rank % self.replicas

    def writes(self, rank: int) -> bool:
        return writes(rank, replicas=self.replicas)

    def copies(self) -> range:
        """The ranks whose keys hold a copy: every one must be present for a hit."""
        return range(0, self.ranks, self.replicas)


@attrs.frozen
class KeyLayout:
    """Store keys per rank: attention blocks follow ``blocks``, recurrent states ``states``
    (states are always sharded: vLLM splits linear-attention and Mamba heads over the ranks)."""

    blocks: CopyRanks
    states: CopyRanks

    @classmethod
    def per_rank(cls, ranks: int) -> KeyLayout:
        """Every rank writes and reads its own copy of everything (a store inside each worker)."""
        return cls(CopyRanks(ranks), CopyRanks(ranks))

    def of(self, name: str) -> CopyRanks:
        return self.blocks if BLOCK_MARK in name else self.states

    def key(self, name: str, rank: int) -> str:
        """The key rank ``rank`` reads ``name`` from (and writes it to, if it writes)."""
        return rank_key(name, self.of(name).owner(rank))

    def copy_keys(self, name: str) -> list[str]:
        return [rank_key(name, r) for r in self.of(name).copies()]


def name_of(key: str) -> str:
    """The object name in a store key made by :func:`rank_key` (a data-plane layer-group suffix
    ``|g…`` dropped; ``key`` itself if it has no rank)."""
    head, mark, tail = key.split("|", 1)[0].rpartition(RANK_MARK)
    return head if mark and tail.isdigit() else key


@attrs.frozen
class RankReport:
    """What one worker rank's store gained and lost since its last report."""

    rank: int
    incarnation: str  # changes when the worker (and its store) is replaced
    stored: tuple[str, ...] = ()  # names now readable on this rank
    dropped: tuple[str, ...] = ()  # names no longer readable on this rank (applied after stored)

    @property
    def empty(self) -> bool:
        return not self.stored and not self.dropped


class ObjectLookup(Protocol):
    """The scheduler side's view of which objects every rank holds."""

    def exists(self, names: Sequence[str], timeout_s: float) -> list[bool] | None:
        """Per name: held by every rank. None: the answer is unknown (treated as a miss)."""
        ...

    def planned(self, names: Iterable[str]) -> None:
        """The scheduler asked every rank to save ``names`` this step."""
        ...

    def apply(self, report: RankReport) -> None:
        """A worker rank's report (see :class:`RankReport`)."""
        ...


class StoreIndex:
    """Per-rank index of an in-worker store, fed by reports; see the module docstring."""

    def __init__(self, ranks: int) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        # bounded by the ranks' stores: a name leaves when its rank reports it dropped (evicted)
        self._held: list[set[str]] = [set() for _ in range(ranks)]
        self._incarnation: list[str | None] = [None] * ranks
        self._pending: dict[str, set[int]] = {}  # name -> ranks whose outcome has not arrived
        self.counters: dict[str, int] = dict.fromkeys(("reports", "incarnations_replaced"), 0)

    def exists(self, names: Sequence[str], timeout_s: float) -> list[bool]:
        return [n in self._pending or all(n in held for held in self._held) for n in names]

    def planned(self, names: Iterable[str]) -> None:
        for n in names:
            self._pending[n] = set(range(self.ranks))

    def apply(self, report: RankReport) -> None:
        r = report.rank
        if not 0 <= r < self.ranks:
            raise ValueError(f"report from rank {r}; the index has {self.ranks} ranks")
        self.counters["reports"] += 1
        seen = self._incarnation[r]
        if seen != report.incarnation:
            if seen is not None:  # the worker was replaced: its store and its saves in flight are gone
                self.counters["incarnations_replaced"] += 1
                self._held[r].clear()
                self._pending.clear()
            self._incarnation[r] = report.incarnation
        held = self._held[r]
        for n in report.stored:
            held.add(n)
            self._settle(n, r)
        for n in report.dropped:
            held.discard(n)
            self._pending.pop(n, None)

    def _settle(self, name: str, rank: int) -> None:
        waiting = self._pending.get(name)
        if waiting is not None:
            waiting.discard(rank)
            if not waiting:
                del self._pending[name]

    def held(self, rank: int) -> int:
        """Objects the index holds for ``rank`` (planned saves not counted)."""
        return len(self._held[rank])


class StoreProbe:
    """A store every rank and the scheduler reach: ask it for every copy's key (one per rank,
    one per group of replicas for a replicated kind, see :class:`KeyLayout`)."""

    def __init__(self, host: StoreHost, layout: KeyLayout) -> None:
        self.host = host
        self.layout = layout

    def exists(self, names: Sequence[str], timeout_s: float) -> list[bool] | None:
        per_name = [self.layout.copy_keys(n) for n in names]
        present = self.host.exists([k for keys in per_name for k in keys], timeout_s)
        if present is None:
            return None
        out: list[bool] = []
        at = 0
        for keys in per_name:
            out.append(all(present[at:at + len(keys)]))
            at += len(keys)
        return out

    def planned(self, names: Iterable[str]) -> None:
        return None  # the store answers for itself

    def apply(self, report: RankReport) -> None:
        return None


__all__ = ["CopyRanks", "KeyLayout", "ObjectLookup", "RankReport", "StoreIndex", "StoreProbe", "kv_replicas",
           "name_of", "rank_key"]
