"""What the engine's forward needs from the linker between LOOKUP/LOAD and INSERT: rows for the
tokens it computes, a writable state slot (a copy of the prefix's state), checkpoint slots and
the depths they sit at, and the checks an insert must pass before it touches the tree.

The :class:`~hylinker.runtime.linker.facade.Linker` checks that the request is open and
delegates here; this room reaches the linker only through its
:class:`~hylinker.runtime.linker.context.LinkerContext`.
"""

from __future__ import annotations

import numpy as np
import torch

from ...components.admission import CheckpointPolicy, Prefill
from ...components.mamba import checkpoint_depth
from .context import LinkerContext
from .offload_room import OffloadRoom
from .request import PhaseError, Request


class ForwardRoom:
    """Rows, the working slot and checkpoint slots of a request, and the insert's checks."""

    def __init__(self, context: LinkerContext, offloads: OffloadRoom, checkpoints: CheckpointPolicy) -> None:
        self.context = context
        self.offloads = offloads  # it learns the most pages one request has held
        self.checkpoints = checkpoints

    def extend(self, req: Request, n_tokens: int) -> torch.Tensor:
        ctx = self.context
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
            raise ValueError(f"extend takes a token count >= 0, got {n_tokens!r}")
        check_looked_up(req, "extend")
        have = req.rows.numel() // ctx.page
        need = -(-int(n_tokens) // ctx.page)
        if need > have:
            req.rows = torch.cat([req.rows, ctx.tree.alloc_rows(need - have)])
            self.offloads.largest_request_pages = max(self.offloads.largest_request_pages, need)
        return req.rows

    def working_slot(self, req: Request) -> int:
        check_looked_up(req, "working_slot")
        pools = self.context.pools
        if pools.mamba is None:
            raise PhaseError("the layout has no mamba pool")
        if req.working is None:
            req.working = self.context.tree.alloc_slot()
            if req.state_source is not None:
                pools.mamba.copy_slot(req.state_source, req.working)
            else:
                for t in pools.mamba.tensors():
                    t[req.working].zero_()
        return req.working

    def checkpoint_slot(self, req: Request) -> int:
        check_looked_up(req, "checkpoint_slot")
        slot = self.context.tree.alloc_slot()
        req.checkpoints.append(slot)
        return slot

    def checkpoint_depth(self, req: Request, extend_len: int) -> int | None:
        layout = self.context.layout
        return checkpoint_depth(req.prefix_tokens, extend_len, layout.grid, layout.chunk_size)

    def checkpoint_depths(self, req: Request) -> list[int]:
        layout = self.context.layout
        return self.checkpoints.place(Prefill(req.prefix_tokens, len(req.tokens), req.page_keys(),
                                              self.context.page, layout.grid, layout.chunk_size))

    def check_insert(self, req: Request, n_tokens: int, checkpoint_slot: int | None) -> None:
        """Raise unless ``insert(req, n_tokens, checkpoint_slot=...)`` may donate: whole pages
        the request extended, beyond its cached prefix, a checkpoint on the grid (and one
        wherever a hybrid model inserts new tokens), no load in flight."""
        page, grid = self.context.page, self.context.layout.grid
        if req.load is not None and not req.load.finished:
            raise PhaseError("insert while a load is in flight: commit or abort it first")
        if n_tokens % page or n_tokens <= 0:
            raise ValueError(f"insert takes whole pages: {n_tokens} is not a positive multiple of {page}")
        if n_tokens > len(req.tokens):
            raise ValueError(f"insert of {n_tokens} tokens exceeds the request's {len(req.tokens)}")
        if n_tokens > req.rows.numel():
            raise PhaseError(f"insert of {n_tokens} tokens but only {req.rows.numel()} rows were extended")
        if n_tokens < req.prefix_tokens:
            raise ValueError(f"insert of {n_tokens} tokens is inside the cached prefix ({req.prefix_tokens})")
        if checkpoint_slot is not None:
            if checkpoint_slot not in req.checkpoints:
                raise PhaseError("checkpoint_slot must come from checkpoint_slot(req)")
            if n_tokens % grid:
                raise ValueError(f"a checkpoint must sit on the grid ({grid} tokens), got depth {n_tokens}")
        elif self.context.layout.is_hybrid and n_tokens > req.prefix_tokens:
            raise ValueError("a hybrid insert needs the checkpoint at its depth (checkpoint_slot)")


def check_looked_up(req: Request, what: str) -> None:
    # before lookup the request stands on no prefix yet: rows taken now would be dropped
    # by lookup (a leak) and a working state would start from zeros under a restored prefix
    if not req.looked_up:
        raise PhaseError(f"{what} before lookup: look the request up first")


__all__ = ["ForwardRoom", "check_looked_up"]
