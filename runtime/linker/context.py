"""What the linker's rooms share: one explicit object instead of the facade itself.

The :class:`~hylinker.runtime.linker.facade.Linker` builds one :class:`LinkerContext` and hands it to
each room (lookup, restore, offload). A room reads and writes the linker's state only through
it: the layout, config, tree writer, per-pool rules, pools, data plane, store and agreement; the
shared counters (the fields of :class:`~hylinker.runtime.linker.statistics.LinkerStatistics`); and the
facade's few operations a room needs (the open check, moving a request's lock, starting a task
in the linker's task group). Invariants the rooms keep: every tree mutation goes through
``tree``; a task is started only while ``running()`` is true (``spawn`` asserts it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ...components.layout import ModelLayout, PoolKind
from ...components.pool_rules import PoolRule
from ...components.pools import HybridPools
from ...components.radix import Node
from ...stores.base import Store
from ..dataplane.plane import DataPlane
from .agreement import Agreement
from .config import LinkerConfig
from .tree_writer import TreeWriter

if TYPE_CHECKING:
    from .request import Request


@attrs.frozen
class LinkerContext:
    layout: ModelLayout
    config: LinkerConfig
    tree: TreeWriter
    rules: Mapping[PoolKind, PoolRule]
    pools: HybridPools
    data: DataPlane
    store: Store  # what every store call goes through (the resilient wrapper when configured)
    agreement: Agreement
    counters: dict[str, int]  # LinkerStatistics' counted fields, shared by the rooms
    check_open: Callable[[Request], None]  # raises PhaseError unless the request is open
    move_lock: Callable[[Request, Node], None]  # the request now stands on that node
    ceiling_tokens: Callable[[Request], int]  # the most tokens a restore may cover
    prefill_tokens_per_s: Callable[[], float | None]  # the engine's prefill rate (given or observed)
    running: Callable[[], bool]  # the linker's task group is open
    spawn: Callable[..., Any]  # start fn(*args) in the linker's task group (only while running)
    holders: Callable[[], int]  # open requests + offloads in flight (what may still give pages back)

    @property
    def page(self) -> int:
        """Tokens per tree page (page size x DCP size)."""
        return self.layout.tree_page

    @property
    def grid_pages(self) -> int:
        """Tree pages per checkpoint grid step."""
        return self.layout.grid // self.layout.tree_page


__all__ = ["LinkerContext"]
