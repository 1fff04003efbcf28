"""A request's view of the cache and the phase errors: what every room of the
:class:`~hylinker.runtime.linker.facade.Linker` reads and writes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import torch

from ...components.keys import MultimodalSpan, page_keys
from ...components.radix import Node

if TYPE_CHECKING:
    from .context import LinkerContext
    from .restore_room import LoadHandle


class PhaseError(RuntimeError):
    """A phase was called out of order (e.g. commit before load, use after release)."""


@attrs.frozen
class LookupResult:
    prompt_tokens: int
    device_tokens: int  # usable from the device tree now
    store_tokens: int  # restorable from the store on top of that (0: none)

    @property
    def total_tokens(self) -> int:
        return self.device_tokens + self.store_tokens


@attrs.define(eq=False)
class Request:
    """One sequence's view of the cache. Create with :meth:`Linker.request`."""

    id: str
    tokens: npt.NDArray[np.int32]
    seed: bytes
    node: Node  # locked: the cached prefix this request stands on
    page_size: int
    prefix_pages: int = 0  # pages of the prefix owned by the tree
    rows: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.int64))
    store_pages: int = 0  # found by lookup
    store_keys: list[bytes] = attrs.field(factory=list)
    store_boundaries: list[int] = attrs.field(factory=list)  # every restorable count found
    declined_tokens: int = 0  # store hit tokens lookup declined: recomputing them was cheaper
    #: with several ranks: whether some rank loads for this request (LOAD is then collective)
    ranks_load: bool = False
    state_source: int | None = None  # the prefix node's state: copy-on-write source
    working: int | None = None
    checkpoints: list[int] = attrs.field(factory=list)
    load: LoadHandle | None = None
    looked_up: bool = False
    released: bool = False
    releasing: anyio.Event | None = None  # set once a release has finished
    #: the prompt's multimodal inputs (validated): folded into the keys of the pages they overlap
    multimodal: tuple[MultimodalSpan, ...] = ()

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_pages * self.page_size

    def page_keys(self, max_pages: int | None = None) -> list[bytes]:
        """The chained keys of the prompt's whole pages (at most ``max_pages``), under the
        request's seed (deployment, salt, adapter) and its multimodal spans: the keys the device
        tree matches and the store's objects are named by."""
        return page_keys(self.tokens, self.page_size, self.seed, max_pages=max_pages,
                         multimodal=self.multimodal)


class LinkerRoom:
    """A room of the :class:`~hylinker.runtime.linker.facade.Linker` (lookup, restore): it works on the
    linker's own layout, config, tree, per-pool rules, data plane, store and counters, all taken
    from the one :class:`~hylinker.runtime.linker.context.LinkerContext` the linker hands it."""

    def __init__(self, ctx: LinkerContext) -> None:
        self.ctx = ctx
        self.layout = ctx.layout
        self.config = ctx.config
        self.tree = ctx.tree
        self.rules = ctx.rules
        self.data = ctx.data
        self.store = ctx.store
        self.page = ctx.page
        self.grid_pages = ctx.grid_pages
        self._c = ctx.counters
        self.agreement = ctx.agreement


__all__ = ["LinkerRoom", "LookupResult", "PhaseError", "Request"]
