"""The lookup room: LOOKUP (match the device tree and lock the hit, probe the store above it
for every restorable boundary) and TOUCH of a device hit's objects."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...components.keys import object_keys
from ...components.layout import PoolKind
from ...components.lookup import restorable_page_counts
from ...components.radix import MatchResult, Node
from ..dataplane.restore_cost import restore_pays
from ..dataplane.tracing import trace
from .agreement import Boundaries, agreed_boundary
from .request import LinkerRoom, LookupResult, PhaseError, Request

if TYPE_CHECKING:
    from .context import LinkerContext
    from .touch_room import TouchBatcher


class LookupRoom(LinkerRoom):
    """LOOKUP and TOUCH for the :class:`~hylinker.runtime.linker.facade.Linker`."""

    def __init__(self, ctx: LinkerContext, toucher: TouchBatcher) -> None:
        super().__init__(ctx)
        self.toucher = toucher
        self._declines_in_a_row = 0  # restores that pay for themselves: see _paying

    async def lookup(self, req: Request) -> LookupResult:
        """Match the device tree (locking the hit) and probe the store above it."""
        self.ctx.check_open(req)
        if req.looked_up:
            raise PhaseError(f"request {req.id!r} was already looked up")
        req.looked_up = True
        t0 = time.perf_counter()
        ceiling_pages = self.ctx.ceiling_tokens(req) // self.page
        keys = req.page_keys(ceiling_pages)
        m = self.tree.match(keys)
        self.tree.lock(m.node)
        self._stand_on(req, m)
        if m.pages and self.config.touch and self.store.capabilities.touch:
            self._maybe_touch(m.node)
        boundaries: list[int] = []
        if self.config.store_lookup and ceiling_pages > m.pages:
            boundaries = await self._probe(req, keys[m.pages:ceiling_pages], m.pages)
            if boundaries and self.config.decline_slow_restores:
                boundaries = self._paying(req, boundaries)
        device_pages = m.pages
        if self.agreement.collective:
            m, boundaries = await self._agree(req, keys, m, boundaries)
            self._stand_on(req, m)
        req.store_boundaries = boundaries
        store_pages = max(boundaries, default=0)
        self._c["lookups"] += 1
        self._c["lookup_prompt_tokens"] += len(req.tokens)
        self._c["device_hit_tokens"] += m.pages * self.page
        self._c["lookup_hits"] += bool(m.pages or store_pages)
        req.store_pages = store_pages
        req.store_keys = keys[m.pages: m.pages + store_pages]
        trace("lookup", request_id=req.id, prompt=len(req.tokens), device_pages=m.pages,
              store_pages=store_pages, node=m.node.id, local_device_pages=device_pages,
              us=round((time.perf_counter() - t0) * 1e6))
        return LookupResult(len(req.tokens), m.pages * self.page, store_pages * self.page)

    def _paying(self, req: Request, boundaries: list[int]) -> list[int]:
        """The boundaries whose restore is expected to beat recomputing it (``restore_cost``):
        a load costs its pages' objects plus one object of every other pool (the state)."""
        rate = self.ctx.prefill_tokens_per_s()
        paying = []
        for b in boundaries:
            nbytes = sum(b * self.data.object_bytes(kind) if kind is PoolKind.FULL else self.data.object_bytes(kind)
                         for kind in self.data.codecs)
            if restore_pays(nbytes, b * self.page, self.data.bandwidth, rate, self.config.restore_margin):
                paying.append(b)
        if len(paying) < len(boundaries):
            if self._declines_in_a_row >= self.config.decline_probe_every:
                # a probe: this load measures the bandwidth again (the store may have recovered)
                self._declines_in_a_row = 0
                self._c["decline_probes"] += 1
                trace("lookup.decline_probe", request_id=req.id, load_bytes_per_s=self.data.bandwidth.per_s)
                return boundaries
            self._declines_in_a_row += 1
            declined = (max(boundaries) - max(paying, default=0)) * self.page
            self._c["declined_lookups"] += 1
            self._c["declined_hit_tokens"] += declined
            req.declined_tokens = declined
            trace("lookup.declined", request_id=req.id, tokens=declined, prefill_tokens_per_s=rate,
                  load_bytes_per_s=self.data.bandwidth.per_s)
        else:
            self._declines_in_a_row = 0
        return paying

    @staticmethod
    def _stand_on(req: Request, m: MatchResult) -> None:
        """The request stands on ``m``'s node (locked by the caller): its prefix."""
        req.node = m.node
        req.prefix_pages = m.pages
        req.rows = m.rows
        req.state_source = m.node.mamba_slot

    async def _agree(self, req: Request, keys: list[bytes], m: MatchResult, boundaries: list[int]
                     ) -> tuple[MatchResult, list[int]]:
        """The MIN over ranks of the restorable boundary, over the *sets* each rank can restore
        (device tree and store): every rank stands on the same prefix afterwards. A rank whose
        device hit is deeper moves its lock back to the agreed boundary; a rank whose hit is
        shallower loads the rest. Also settles whether LOAD is collective for this request."""
        points = None
        if self.layout.is_hybrid:
            points = tuple(n.end_page for n in m.node.path() if n.mamba_slot is not None)
        mine: Boundaries = (m.pages, points, tuple(m.pages + b for b in boundaries))
        reports: list[Boundaries] = await self.agreement.gather("requests", "lookup", req.id, mine)
        agreed = agreed_boundary(reports)
        req.ranks_load = any(agreed > device for device, _, _ in reports)
        if agreed < max(mine[2], default=m.pages):
            self._c["rank_shortened_lookups"] += 1
            trace("lookup.rank_shortened", request_id=req.id, local=max(mine[2], default=m.pages),
                  agreed=agreed)
        if agreed >= m.pages:
            # shallower boundaries stay: a load reads fallback states at them
            return m, [b for b in boundaries if m.pages + b <= agreed]
        # the agreed prefix lies inside this rank's device hit: stand on it instead
        shorter = self.tree.match(keys[:agreed])
        if shorter.pages != agreed:
            raise AssertionError(f"device tree restores {shorter.pages} pages, agreed {agreed}")
        self.tree.lock(shorter.node)
        self.tree.unlock(m.node)
        return shorter, []

    async def _probe(self, req: Request, keys: list[bytes], first_page: int) -> list[int]:
        """Every restorable page count above the device hit, ascending ([]: none)."""
        names: dict[PoolKind, list[str]] = {}
        spans: dict[PoolKind, list[int]] = {}
        for kind, rule in self.rules.items():
            pos = rule.probe_positions(first_page, len(keys), self.grid_pages)
            spans[kind] = pos
            names[kind] = object_keys([keys[i] for i in pos], kind, self.layout)
        if not any(names.values()):
            return []
        errors = self.data.statistics().exists_errors
        # a store error, or an answer of the wrong length, is a miss for every key (fail closed)
        present = await self.data.exists(names)
        if self.data.statistics().exists_errors > errors:
            trace("lookup.store_error", request_id=req.id)
            return []
        bits: dict[PoolKind, list[bool]] = {}
        for kind, pos in spans.items():
            b = [False] * len(keys)
            for j, i in enumerate(pos):
                b[i] = present[kind][j]
            bits[kind] = b
        counts = restorable_page_counts(bits)
        return sorted(n for n in counts if n > 0 and (first_page + n) % self.grid_pages == 0)

    def _maybe_touch(self, node: Node) -> None:
        now = time.monotonic()
        if now - node.last_touch < self.config.touch_interval_s:
            return
        node.last_touch = now
        keys = self.tree.path_keys(node)
        names = [name for rule in self.rules.values() for name in rule.touch_names(keys, node)]
        self._c["touches"] += 1
        self._c["touch_keys"] += len(names)
        self.toucher.add(names)

