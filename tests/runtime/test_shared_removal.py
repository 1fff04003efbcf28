"""A shared store is shared trust: a reader removes only what it proved bad, exactly as read
(``stores/condemned.py``; issue 42 item 2).

Engine A fills the store; engine B, whose reads fail (``FAILED`` answers, timeouts, an
unreachable store), loads the same prompts: every object stays, and a healthy engine C with
fresh pools restores them all afterwards. On the embedded store and on Mooncake (the session's
master). And a removal never deletes an object another engine rewrote after the reader
condemned it: atomically on the embedded store, by a compare before the remove elsewhere."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import anyio
import numpy as np
import pytest
import torch

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores import framing
from hylinker.stores.base import GetResult, Outcome, Store, StoreUnavailableError
from hylinker.stores.condemned import Condemned, ConditionalRemoveStore, remove_condemned
from hylinker.stores.embedded import EmbeddedStore
from hylinker.stores.rows import RowBatch, RowResults
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import GatedStore, small_hybrid_layout, synthetic_prefill

LAYOUT = small_hybrid_layout()  # page 4, grid 8 tokens
_ids = itertools.count()


class ReadsFail(GatedStore):
    """Forwards everything but reads, which fail the way ``mode`` says: ``"failed"`` (the store
    answers FAILED), ``"timeout"`` (what a call past its deadline answers: UNREACHABLE) or
    ``"unreachable"`` (the call raises)."""

    def __init__(self, inner: Store, mode: str) -> None:
        super().__init__(inner)
        self.mode = mode
        self.fail_gets = mode == "failed"

    async def _unread(self, n: int) -> list[GetResult]:
        await anyio.sleep(0.002)
        if self.mode == "unreachable":
            raise StoreUnavailableError("injected: the store is unreachable")
        return [GetResult(Outcome.UNREACHABLE)] * n

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        return await super().get(keys, buffers) if self.fail_gets else await self._unread(len(keys))

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await super().get_parts(keys, parts) if self.fail_gets else await self._unread(len(keys))

    async def get_checked(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        return await super().get_checked(keys, parts) if self.fail_gets else await self._unread(len(keys))

    async def get_rows(self, batch: RowBatch, hashed: bool) -> RowResults:
        if self.fail_gets:
            return await super().get_rows(batch, hashed)
        await self._unread(len(batch.keys))
        return RowResults.of(len(batch.keys), Outcome.UNREACHABLE)


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 30000, size=n).astype(np.int32)


def _linker(store: Store) -> tuple[Linker, SyntheticContent]:
    pools = HybridPools(LAYOUT, kv_pages=64, mamba_slots=16)
    return Linker(LAYOUT, pools, store, LinkerConfig(staging_bytes_per_pool=1 << 16)), SyntheticContent(pools)


async def _donate(linker: Linker, content: SyntheticContent, tokens: np.ndarray) -> None:
    req = linker.request(f"donor{next(_ids)}", tokens)
    await linker.lookup(req)
    await synthetic_prefill(linker, content, req)
    await linker.release(req)
    await linker.drain()


async def _restore(linker: Linker, content: SyntheticContent, tokens: np.ndarray, *, hit: bool = True) -> int:
    """Tokens a request restored from the store (its content checked). ``hit``: its lookup must
    find them (a reader whose reads time out opens its store's breaker: later lookups miss)."""
    req = linker.request(f"reader{next(_ids)}", tokens)
    found = (await linker.lookup(req)).store_tokens
    assert found > 0 or not hit
    load = await linker.load(req)
    restored = 0 if load is None else await linker.commit(load)
    assert content.prefix_problems(linker, req) == []
    await linker.release(req)
    await linker.drain()
    return restored


async def _failing_reader_removes_nothing(store: Store, mode: str) -> None:
    prompts = [_prompt(41, seed) for seed in range(3)]
    a, a_content = _linker(store)
    async with a:
        for p in prompts:
            await _donate(a, a_content, p)
        a.flush_device()
    before = store.statistics().removes
    b, b_content = _linker(ReadsFail(store, mode))
    async with b:
        for p in prompts:
            assert await _restore(b, b_content, p, hit=False) == 0  # nothing of it arrived
        stats = b.statistics()
        b.flush_device()
    assert stats.failed_objects_kept > 0
    assert (stats.bad_objects_removed, stats.bad_objects_rewritten) == (0, 0)
    assert store.statistics().removes == before  # no remove reached the store
    c, c_content = _linker(store)
    async with c:
        for p in prompts:
            assert await _restore(c, c_content, p) == 40  # every page and the state at 40
        c.flush_device()


@pytest.mark.parametrize("mode", ["failed", "timeout", "unreachable"])
async def test_a_reader_whose_reads_fail_leaves_every_object_for_the_next_engine(mode: str) -> None:
    store = EmbeddedStore(8 << 20)
    try:
        await _failing_reader_removes_nothing(store, mode)
    finally:
        await store.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("mode", ["failed", "timeout"])
async def test_a_reader_whose_reads_fail_leaves_every_object_on_mooncake(mooncake_store: Store, mode: str) -> None:
    await _failing_reader_removes_nothing(mooncake_store, mode)


# ---- a removal names the exact object it condemned ----------------------------------------


def _frame(key: str, fill: int, size: int = 256) -> torch.Tensor:
    frame = torch.full((framing.HEADER_BYTES + size,), fill, dtype=torch.uint8)
    framing.seal(frame, key, b"layout!!")
    return frame


async def _rewritten_object_survives(store: Store) -> None:
    bad, other = "condemned/bad", "condemned/rewritten"
    frames = {k: _frame(k, 1) for k in (bad, other)}
    for f in frames.values():
        f[-1] ^= 0xFF  # payload no longer matches its checksum: bad
    assert await store.put([bad, other], list(frames.values())) == [Outcome.OK] * 2
    condemned = {k: Condemned.of(f.numel(), f.numpy(), framing.FrameFault.BAD_CHECKSUM.value)
                 for k, f in frames.items()}
    # meanwhile another engine removed ``other`` and wrote a good object under its key
    assert await store.remove([other]) == 1
    good = _frame(other, 2)
    assert await store.put([other], [good]) == [Outcome.OK]
    assert await remove_condemned(store, condemned) == 1
    assert await store.exists([bad, other]) == [False, True]
    back = torch.zeros_like(good)
    assert (await store.get([other], [back]))[0].outcome is Outcome.OK and torch.equal(back, good)


async def test_a_removal_never_deletes_an_object_rewritten_meanwhile() -> None:
    store = EmbeddedStore(1 << 20)
    try:
        assert isinstance(store, ConditionalRemoveStore)  # compare and remove in one step
        await _rewritten_object_survives(store)
        generic = GatedStore(EmbeddedStore(1 << 20))  # no remove_if: read, compare, remove
        assert not isinstance(generic, ConditionalRemoveStore)
        await _rewritten_object_survives(generic)
        await generic.close()
    finally:
        await store.close()


@pytest.mark.mooncake
async def test_a_removal_never_deletes_an_object_rewritten_meanwhile_on_mooncake(mooncake_store: Store) -> None:
    await _rewritten_object_survives(mooncake_store)
