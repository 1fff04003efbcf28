"""The lookup room: LOOKUP (match the device tree and lock the hit, probe the store above it
for every restorable boundary) and TOUCH of a device hit's objects."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..components.keys import object_keys, page_keys
from ..components.layout import PoolKind
from ..components.lookup import restorable_page_counts
from ..components.radix import Node
from .request import LinkerRoom, LookupResult, PhaseError, Request
from .tracing import trace

if TYPE_CHECKING:
    from .linker import Linker


class LookupRoom(LinkerRoom):
    """LOOKUP and TOUCH for the :class:`~hylinker.runtime.linker.Linker`."""

    def __init__(self, linker: Linker) -> None:
        super().__init__(linker)
        self.toucher = linker.toucher

    async def lookup(self, req: Request) -> LookupResult:
        """Match the device tree (locking the hit) and probe the store above it."""
        self.linker._check_open(req)
        if req.looked_up:
            raise PhaseError(f"request {req.id!r} was already looked up")
        req.looked_up = True
        t0 = time.perf_counter()
        ceiling_pages = self.linker.ceiling_tokens(req) // self.page
        keys = page_keys(req.tokens, self.page, req.seed, max_pages=ceiling_pages)
        m = self.tree.match(keys)
        self.tree.lock(m.node)
        req.node = m.node
        req.prefix_pages = m.pages
        req.rows = m.rows
        req.state_source = m.node.mamba_slot
        self._c["lookups"] += 1
        self._c["lookup_prompt_tokens"] += len(req.tokens)
        self._c["device_hit_tokens"] += m.pages * self.page
        if m.pages and self.config.touch and self.store.capabilities.touch:
            self._maybe_touch(m.node)
        store_pages = 0
        req.store_boundaries = []
        if self.config.store_lookup and ceiling_pages > m.pages:
            req.store_boundaries = await self._probe(req, keys[m.pages:ceiling_pages], m.pages)
            store_pages = max(req.store_boundaries, default=0)
        req.store_pages = store_pages
        req.store_keys = keys[m.pages: m.pages + store_pages]
        trace("lookup", request_id=req.id, prompt=len(req.tokens), device_pages=m.pages,
              store_pages=store_pages, node=m.node.id, us=round((time.perf_counter() - t0) * 1e6))
        return LookupResult(len(req.tokens), m.pages * self.page, store_pages * self.page)

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
        errors = self.data.statistics()["exists_errors"]
        # a store error, or an answer of the wrong length, is a miss for every key (fail closed)
        present = await self.data.exists(names)
        if self.data.statistics()["exists_errors"] > errors:
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

