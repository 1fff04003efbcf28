"""SGLang's pool transfers as the data plane's: which object keys and which rows of this rank's
pools a transfer names (DRAFT derived from the KV rows; under DCP the rows this rank holds), and
for an offload which of them this rank writes (a rank-replicated pool: rank 0 only; not what a
load just restored). Used by :class:`~hylinker.integrations.sglang.HylinkerLinker`; imports no
SGLang."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...components.layout import PoolKind
from ...runtime.dataplane.plane import Transfer
from ...runtime.dataplane.sync_plane import SyncDataPlane
from .load_ends import KeyMemory
from .pools import PoolLayoutError, SGLangPool

KINDS = {kind.value: kind for kind in PoolKind}  # SGLang's PoolName values are ours: kv, swa, mamba, draft


class TransferNames:
    """Object keys and rows of this rank's pools (``pools``), each kind's key ``suffix`` and
    whether this rank ``writes`` it."""

    def __init__(self, pools: Mapping[PoolKind, SGLangPool], suffix: Mapping[PoolKind, str],
                 writes: Mapping[PoolKind, bool], data: SyncDataPlane, restored: KeyMemory,
                 count: Callable[..., None]) -> None:
        self.pools = pools
        self.kinds = set(pools)
        self.suffix = suffix
        self.writes = writes
        self.data = data
        self.restored = restored
        self.count = count

    def object_keys(self, pool: str, page_keys: Sequence[str]) -> list[str]:
        suffix = self.suffix[KINDS[pool]]
        return [k + suffix for k in page_keys]

    def rows(self, pool: str, indices: torch.Tensor) -> torch.Tensor:
        return self.pools[KINDS[pool]].rows(indices)

    def transfers(self, transfers: Sequence[Any], *, offload: bool) -> tuple[list[Transfer], list[str]]:
        """SGLang's transfers as the data plane's (DRAFT derived from the KV rows), and every
        object key they name. Raises :class:`PoolViewError` for malformed transfers."""
        by_name = {str(getattr(t.name, "value", t.name)): t for t in transfers}
        unknown = set(by_name) - {k.value for k in self.kinds}
        if unknown:
            raise PoolLayoutError(f"transfers for pools this linker does not hold: {sorted(unknown)}")
        named: list[tuple[PoolKind, list[str], Any]] = []
        kv = by_name.get("kv")
        if kv is not None and kv.keys:  # a load may lack it: the pages are on the device already
            if kv.device_indices is None:
                raise PoolLayoutError("a KV transfer without rows")
            pages = list(kv.keys)
            named.append((PoolKind.FULL, self.object_keys("kv", pages), kv.device_indices))
            if PoolKind.DRAFT in self.kinds:
                named.append((PoolKind.DRAFT, self.object_keys("draft", pages), kv.device_indices))
        for kind in (PoolKind.SWA, PoolKind.MAMBA):  # SWA pages on their own rows; the state's slot
            side = by_name.get(kind.value)
            if side is not None and side.keys:
                if side.device_indices is None:
                    raise PoolLayoutError(f"a {kind.value} transfer without rows")
                named.append((kind, self.object_keys(kind.value, list(side.keys)), side.device_indices))
        out: list[Transfer] = []
        every: list[str] = []
        for kind, keys, indices in named:
            index = self.data.plane.pools[kind].objects(self.rows(kind.value, indices))
            every += keys
            if offload:  # a rank-replicated pool is written by rank 0; restored objects not again
                if not self.writes[kind]:
                    continue
                keep = [i for i, fresh in enumerate(self.restored.absent(keys)) if fresh]
                self.count("objects_skipped_restored", len(keys) - len(keep))
                if len(keep) < len(keys):
                    keys, index = [keys[i] for i in keep], index[keep]
            if keys:
                out.append(Transfer(kind, keys, index))
        return out, every


__all__ = ["KINDS", "TransferNames"]
