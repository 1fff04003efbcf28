"""The stress tool's synthetic forward: its model geometries and the bytes it "computes".

The forward writes, for every whole page, content that is a function of the page key and the
position (KV and draft rows), and for every checkpoint a state that is a function of the
boundary's page key. Every restored page and state can then be checked byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..components.layout import MambaLayerSpec, ModelLayout, PoolKind
from ..components.pools import HybridPools

PRESETS = ("kimi", "attention")


# ---- geometry ---------------------------------------------------------------------------

def preset_layout(name: str, page_size: int = 64, chunk_size: int = 64, *, tp_rank: int = 0,
                  tp_size: int = 1, replicated: Sequence[PoolKind | str] = ()) -> ModelLayout:
    """Stress geometries, scaled to this machine (one tensor-parallel rank's share of them:
    ``tp_rank`` of ``tp_size``, with the ``replicated`` pools the same on every rank).

    * ``kimi``: Kimi-K3-like ratios — one MLA-like KV layer (fp8, 256 B per token), four
      KDA layers whose states add up to ~65 KV pages of 64 tokens (the real ratio: one state is
      worth ~64 pages), a one-layer draft model.
    * ``attention``: plain attention, four layers of 64 B per token, no states, no draft.
    """
    if name == "kimi":
        kda = [MambaLayerSpec(layer_id=i, conv_shape=(4, 256), conv_dtype=torch.float32,
                              temporal_shape=(4, 128, 128), temporal_dtype=torch.float32)
               for i in (0, 1, 2)]
        kda.append(MambaLayerSpec(layer_id=4, conv_shape=(4, 256), conv_dtype=torch.float32,
                                  temporal_shape=(4, 128, 128), temporal_dtype=torch.float32))
        return ModelLayout.create(page_size=page_size, chunk_size=chunk_size, full_layers=[3],
                                  kv_row_shape=[256], kv_dtype="float8_e4m3fn", mamba_layers=kda,
                                  draft_layers=1, draft_row_shape=[32], draft_dtype="bfloat16",
                                  model_name="stress-kimi", tp_rank=tp_rank, tp_size=tp_size,
                                  replicated=replicated)
    if name == "attention":
        return ModelLayout.create(page_size=page_size, chunk_size=chunk_size, full_layers=[0, 1, 2, 3],
                                  kv_row_shape=[32], kv_dtype="bfloat16", model_name="stress-attention",
                                  tp_rank=tp_rank, tp_size=tp_size, replicated=replicated)
    raise ValueError(f"unknown preset {name!r}; choose from {PRESETS}")


# ---- synthetic content -------------------------------------------------------------------

class Content:
    """Deterministic bytes for every page and state: a function of the page key and position.

    A page's byte ``b`` of token ``p`` in layer ``l`` is ``TABLE[(s + l * P + p) % M, b]``
    with ``s`` taken from the page key, so content is cheap to write and to check (a gather)
    and two different pages coincide with probability ~1/M.
    """

    M = 65521

    def __init__(self, layout: ModelLayout, pools: HybridPools, seed: int = 0) -> None:
        self.layout = layout
        self.pools = pools
        g = torch.Generator().manual_seed(seed)
        self.views: dict[PoolKind, torch.Tensor] = {}
        self.tables: dict[PoolKind, torch.Tensor] = {}
        for kind, t in ((PoolKind.FULL, pools.kv.tensor),
                        (PoolKind.DRAFT, pools.draft.tensor if pools.draft is not None else None)):
            if t is None:
                continue
            v = t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)
            self.views[kind] = v
            self.tables[kind] = torch.randint(0, 256, (self.M, v.shape[2]), generator=g, dtype=torch.uint8)
        self.state_views: list[torch.Tensor] = []
        if pools.mamba is not None:
            self.state_views = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in pools.mamba.tensors()]
            width = sum(v.shape[1] for v in self.state_views)
            self.state_table = torch.randint(0, 256, (self.M + width // 64 + 1, 64), generator=g,
                                             dtype=torch.uint8)

    @staticmethod
    def _seed(keys: Sequence[bytes]) -> torch.Tensor:
        return torch.tensor([int.from_bytes(k[:7], "little") for k in keys], dtype=torch.int64)

    def _page_index(self, keys: Sequence[bytes], n_layers: int) -> torch.Tensor:
        P = self.layout.page_size
        s = self._seed(keys)  # [n]
        idx = s[:, None, None] + torch.arange(n_layers)[None, :, None] * P + torch.arange(P)[None, None, :]
        return (idx % self.M).transpose(0, 1).reshape(n_layers, -1)  # [L, n*P]

    def write_pages(self, keys: Sequence[bytes], rows: torch.Tensor) -> None:
        if not keys:
            return
        for kind, v in self.views.items():
            idx = self._page_index(keys, v.shape[0])
            v[:, rows] = self.tables[kind][idx]

    def check_pages(self, keys: Sequence[bytes], rows: torch.Tensor) -> int:
        """Number of pages whose content differs from what it must be."""
        if not keys:
            return 0
        bad = torch.zeros(len(keys), dtype=torch.bool)
        P = self.layout.page_size
        for kind, v in self.views.items():
            idx = self._page_index(keys, v.shape[0])
            diff = (v[:, rows] != self.tables[kind][idx]).reshape(v.shape[0], len(keys), P, -1)
            bad |= diff.any(dim=3).any(dim=2).any(dim=0)
        return int(bad.sum())

    def _state_bytes(self, key: bytes) -> list[torch.Tensor]:
        s = int.from_bytes(key[:7], "little") % self.M
        out = []
        off = 0
        for v in self.state_views:
            n = v.shape[1]
            rows = -(-n // 64)
            out.append(self.state_table[s + off // 64: s + off // 64 + rows].reshape(-1)[:n])
            off += n
        return out

    def write_state(self, key: bytes, slot: int) -> None:
        for v, b in zip(self.state_views, self._state_bytes(key)):
            v[slot] = b

    def check_state(self, key: bytes, slot: int) -> bool:
        return all(torch.equal(v[slot], b) for v, b in zip(self.state_views, self._state_bytes(key)))
