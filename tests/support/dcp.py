"""Decode-context parallel (DCP) ranks for tests: an engine's share of each tree page on one
rank, and a rank process over a Mooncake master.

Under DCP a tree page's ``W = dcp_size * page_size`` tokens are interleaved over the DCP ranks
(token ``o`` of a page on rank ``o % dcp_size``). :class:`DcpContent` plays a DCP engine's
forward for one rank: it writes this rank's tokens of a *logical* page (a function of the page
key, the token's offset in the page and the layer, so every rank's bytes differ) at the rows
:func:`~hylinker.components.pools.dcp_fold` names, and checks them after a restore. A recurrent
state is per TP rank: :meth:`DcpContent.write_state` writes this TP rank's shard.

``python -m hylinker.tests.support.dcp --master HOST:PORT --dcp N --rank R --phase {offload,restore}``
runs one rank in its own process, on a pure-client Mooncake store (the objects live in the
segment of whoever contributes one, so they outlive the process): ``offload`` prefills a prompt
and writes it through, ``restore`` (in a fresh process, with fresh pools) restores it and checks
every row. It prints one JSON line: the keys it put, the depth, the rows it restored, the
problems it found and what leaked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import anyio
import numpy as np
import torch

from ...components.layout import MambaLayerSpec, ModelLayout
from ...components.pools import HybridPools, dcp_fold
from ...runtime.linker.facade import Linker, Request

#: rows a restore must not touch keep this value
SENTINEL = -77.0


def dcp_test_layout(dcp: int, rank: int, *, tp: int | None = None, hybrid: bool = False,
                    replicated: Sequence[str] = (), page_size: int = 4, chunk_size: int = 8) -> ModelLayout:
    """Two full-attention layers (bf16 ``[2, 4]`` rows), one draft layer, optionally one linear
    layer; TP rank ``rank`` of ``tp`` (default ``dcp``), DCP rank ``rank % dcp``."""
    mamba = [MambaLayerSpec(0, (3, 8), torch.float32, (2, 4, 4), torch.float32)] if hybrid else []
    return ModelLayout.create(
        page_size=page_size, chunk_size=chunk_size, full_layers=[1, 3], kv_row_shape=[2, 4],
        kv_dtype="bfloat16", mamba_layers=mamba, draft_layers=1, draft_row_shape=[2, 4], tp_rank=rank,
        tp_size=dcp if tp is None else tp, dcp_rank=rank % dcp, dcp_size=dcp, replicated=replicated)


def dcp_prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


def logical_page(key: bytes, layers: int, width: int, row: Sequence[int], salt: int) -> torch.Tensor:
    """The whole (unsharded) KV of one tree page, ``[layers, width, *row]``: small integers,
    exact in every float dtype, a function of the page key, the token offset and the layer."""
    base = int.from_bytes(key[:6], "little") % 1_000_003 + salt * 7919
    n = layers * width * int(np.prod(row))
    return ((torch.arange(n, dtype=torch.int64) * 40503 + base) % 241 - 120).to(torch.float32).view(
        layers, width, *row)


def state_shard(key: bytes, tp_rank: int, shape: Sequence[int]) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of the recurrent state at a boundary (differs per rank)."""
    base = int.from_bytes(key[:6], "little") % 1_000_003 + 31 * tp_rank
    return ((torch.arange(int(np.prod(shape))) * 7 + base) % 251 - 125).to(torch.float32).view(*shape)


class DcpContent:
    """One DCP rank's share of every page: written like a DCP engine's forward, checked after a
    restore."""

    def __init__(self, pools: HybridPools) -> None:
        self.pools = pools
        self.layout = pools.layout

    def page_tensors(self) -> list[tuple[int, torch.Tensor]]:
        out = [(1, self.pools.kv.tensor)]
        if self.pools.draft is not None:
            out.append((2, self.pools.draft.tensor))
        return out

    def _rows(self, slots: torch.Tensor, i: int) -> torch.Tensor:
        lay = self.layout
        return dcp_fold(slots[i * lay.tree_page:(i + 1) * lay.tree_page], lay.dcp_rank, lay.dcp_size,
                        lay.page_size)

    def _share(self, key: bytes, t: torch.Tensor, salt: int) -> torch.Tensor:
        lay = self.layout
        full = logical_page(key, t.shape[0], lay.tree_page, t.shape[2:], salt)
        return full[:, lay.dcp_rank::lay.dcp_size].to(t.dtype)

    def write_pages(self, keys: Sequence[bytes], slots: torch.Tensor) -> None:
        """This rank's tokens of page ``i`` (token slots ``slots[i*W:(i+1)*W]``), at its rows."""
        for i, k in enumerate(keys):
            rows = self._rows(slots, i)
            for salt, t in self.page_tensors():
                t[:, rows] = self._share(k, t, salt)

    def pages_hold(self, keys: Sequence[bytes], slots: torch.Tensor) -> list[int]:
        """Pages whose rows on this rank do not hold this rank's share (empty: all good)."""
        bad = []
        for i, k in enumerate(keys):
            rows = self._rows(slots, i)
            if not all(torch.equal(t[:, rows].view(torch.uint8), self._share(k, t, salt).view(torch.uint8))
                       for salt, t in self.page_tensors()):
                bad.append(i)
        return bad

    def untouched_outside(self, slots: torch.Tensor) -> bool:
        """Whether every row not folded from ``slots`` still holds :data:`SENTINEL`."""
        lay = self.layout
        outside = torch.ones(self.pools.kv.capacity_rows, dtype=torch.bool)
        outside[dcp_fold(slots, lay.dcp_rank, lay.dcp_size, lay.page_size)] = False
        return all(bool((t[:, outside] == SENTINEL).all()) for _, t in self.page_tensors())

    def fill_sentinel(self) -> None:
        for _, t in self.page_tensors():
            t.fill_(SENTINEL)

    def write_state(self, key: bytes, slot: int) -> None:
        assert self.pools.mamba is not None
        for t in self.pools.mamba.tensors():
            t[slot] = state_shard(key, self.layout.tp_rank, t.shape[1:])

    def state_holds(self, key: bytes, slot: int) -> bool:
        assert self.pools.mamba is not None
        return all(torch.equal(t[slot], state_shard(key, self.layout.tp_rank, t.shape[1:]))
                   for t in self.pools.mamba.tensors())


async def dcp_prefill(linker: Linker, content: DcpContent, req: Request) -> int:
    """The forward of a looked-up request with nothing cached: extend, write this rank's share
    of every whole page (and a state), insert up to the last grid boundary, release, drain.
    Returns the inserted depth."""
    lay = linker.layout
    n = len(req.tokens)
    slots = linker.extend(req, n)
    keys = req.page_keys()
    content.write_pages(keys, slots[: len(keys) * lay.tree_page])
    depth = n // linker.grid * linker.grid
    if lay.is_hybrid:
        linker.working_slot(req)
        slot = linker.checkpoint_slot(req)
        content.write_state(keys[depth // lay.tree_page - 1], slot)
        await linker.insert(req, depth, checkpoint_slot=slot)
    else:
        await linker.insert(req, depth)
    await linker.release(req)
    await linker.drain()
    return depth


async def dcp_restore(linker: Linker, content: DcpContent, tokens: np.ndarray, request_id: str,
                      *, salt: str | None = None) -> tuple[int, list[str]]:
    """Flush the device, fill the rows with :data:`SENTINEL`, restore ``tokens`` from the store
    and check this rank's rows. Returns the tokens restored and the problems found."""
    linker.flush_device()
    content.fill_sentinel()
    lay = linker.layout
    req = linker.request(request_id, tokens, salt=salt)
    problems: list[str] = []
    try:
        hit = await linker.lookup(req)
        if hit.device_tokens:
            problems.append(f"device hit {hit.device_tokens} after a flush")
        load = await linker.load(req)
        if load is None:
            return 0, [*problems, "no load"]
        restored = await linker.commit(load)
        slots = req.rows[:restored]
        keys = req.page_keys(restored // lay.tree_page)
        problems += [f"page {i}" for i in content.pages_hold(keys, slots)]
        if not content.untouched_outside(slots):
            problems.append("a restore wrote rows this rank does not hold")
        if lay.is_hybrid and restored and (req.state_source is None
                                           or not content.state_holds(keys[-1], req.state_source)):
            problems.append("state")
        return restored, problems
    finally:
        await linker.release(req)


async def _rank_main(args: argparse.Namespace) -> dict[str, object]:
    from ...runtime.linker.config import LinkerConfig
    from ...stores.mooncake import MooncakeConfig, MooncakeStore
    from ...testing.fakes import GatedStore

    lay = dcp_test_layout(args.dcp, args.rank, hybrid=args.hybrid)
    tokens = dcp_prompt(args.tokens, seed=args.seed)
    inner = await MooncakeStore.open(MooncakeConfig(
        master_address=args.master, segment_bytes=0, bounce_bytes=1 << 20, workers=2))
    try:
        store = GatedStore(inner)  # records the keys this rank puts
        pools = HybridPools(lay, kv_pages=32, mamba_slots=8 if lay.is_hybrid else 0)
        content = DcpContent(pools)
        out: dict[str, object] = {"rank": args.rank, "phase": args.phase}
        async with Linker(lay, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 16)) as linker:
            if args.phase == "offload":
                req = linker.request("donor", tokens, salt=args.salt)
                hit = await linker.lookup(req)
                out["store_hit"] = hit.store_tokens
                out["depth"] = await dcp_prefill(linker, content, req)
            else:
                restored, problems = await dcp_restore(linker, content, tokens, "restore", salt=args.salt)
                out["restored"] = restored
                out["problems"] = problems
            await linker.drain()
            out["offload_failures"] = linker.statistics().offload_failures
            out["leaked"] = list(linker.leaked())
        out["puts"] = store.put_keys()
        linker.flush_device()
        pools.check_idle()
        return out
    finally:
        await inner.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hylinker.tests.support.dcp", description=__doc__)
    ap.add_argument("--master", required=True, help="mooncake_master HOST:PORT")
    ap.add_argument("--dcp", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--phase", choices=["offload", "restore"], required=True)
    ap.add_argument("--tokens", type=int, default=51)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--salt", default="")
    ap.add_argument("--hybrid", action="store_true")
    args = ap.parse_args(argv)
    out = anyio.run(_rank_main, args)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
