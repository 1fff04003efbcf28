"""Synthetic content: the bytes a synthetic forward "computes", and the stress tool's geometries.

:class:`SyntheticContent` writes, for every whole page, content that is a function of the page key
and the position (KV and draft rows), and for every checkpoint a state that is a function of the
boundary's last page key. Every restored page and state can then be checked byte for byte. The
tests, the stress tool, the fleet and the engine servers all use this one class.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..components.layout import MambaLayerSpec, ModelLayout, PoolKind
from ..components.pools import HybridPools

if TYPE_CHECKING:
    from ..runtime.linker.facade import Linker, Request

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

_PERIOD = 241  # a prime: the pattern's values repeat every 241 elements
_STEP = 40503 % _PERIOD
_INVERSE = pow(_STEP, -1, _PERIOD)


@functools.lru_cache(maxsize=16)
def _windows(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Every window of ``numel`` elements of the periodic sequence ``(STEP * i) % 241 - 120`` in
    ``dtype``: ``[241, numel]``, a view of one tensor."""
    seq = ((torch.arange(numel + _PERIOD, dtype=torch.int64) * _STEP) % _PERIOD - 120).to(torch.float32)
    return seq.to(dtype).as_strided((_PERIOD, numel), (1, 1))


def _pattern(keys: Sequence[bytes], numel: int, salt: int, dtype: torch.dtype) -> torch.Tensor:
    """``[len(keys), numel]`` small integers (-120..120: no NaN or infinity in any float dtype) in
    ``dtype``, a function of each key and the salt: element ``i`` of a key with offset ``b`` is
    ``(STEP * i + b) % 241 - 120``, which is the periodic sequence shifted by ``b / STEP`` (mod 241),
    so each key's content is one window of a cached sequence."""
    shifts = [((int.from_bytes(k[:6], "little") % 1_000_003 + salt * 7919) * _INVERSE) % _PERIOD for k in keys]
    windows = _windows(numel, dtype)
    if len(shifts) == 1:  # a view, no copy
        return windows[shifts[0]:shifts[0] + 1]
    return windows[torch.tensor(shifts, dtype=torch.int64)]


class SyntheticContent:
    """Deterministic pool content: a function of the page key (KV, draft rows of that page) or of
    the boundary's last page key (a state), and of ``seed``. Same key and seed, same bytes, on every
    rank and host. Written and compared as bytes, so every pool dtype (fp8 included) works.

    Invariant the caller keeps: ``rows`` holds ``page_size`` rows per key, in key order.
    """

    def __init__(self, pools: HybridPools, seed: int = 0) -> None:
        if pools.layout.dcp_size > 1:
            raise ValueError("SyntheticContent writes whole pages on one rank; under DCP a page's tokens are "
                             "interleaved over ranks (tests/support/dcp.py's DcpContent writes each rank's share)")
        self.pools = pools
        self.layout = pools.layout
        self.page = self.layout.page_size
        self.seed = seed

    def _salt(self, salt: int) -> int:
        return salt + 101 * self.seed

    def _pages(self, t: torch.Tensor, keys: Sequence[bytes], salt: int) -> torch.Tensor:
        """Content of ``keys``' pages for pool tensor ``t`` as bytes, shaped like ``t[:, rows]``'s bytes."""
        per_page = t.shape[0] * self.page * int(torch.Size(t.shape[2:]).numel())
        x = _pattern(keys, per_page, self._salt(salt), t.dtype).view(len(keys), t.shape[0], self.page, *t.shape[2:])
        pages = x.transpose(0, 1).reshape(t.shape[0], len(keys) * self.page, *t.shape[2:]).view(torch.uint8)
        return pages.to(t.device)  # device pools: the content is made on the host

    def write_pages(self, keys: Sequence[bytes], rows: torch.Tensor) -> None:
        """Write page ``i``'s content into ``rows[i*P:(i+1)*P]`` of the KV (and draft) pool."""
        self._check_rows(keys, rows)
        if not keys:
            return
        for salt, t in self._page_tensors():
            t.view(torch.uint8)[:, rows] = self._pages(t, keys, salt)

    def pages_match(self, keys: Sequence[bytes], rows: torch.Tensor) -> list[int]:
        """Indices of pages whose rows do not hold their content (empty: all good)."""
        self._check_rows(keys, rows)
        if not keys:
            return []
        bad: set[int] = set()
        for salt, t in self._page_tensors():
            have = t.view(torch.uint8)[:, rows].reshape(t.shape[0], len(keys), -1)
            want = self._pages(t, keys, salt).reshape(t.shape[0], len(keys), -1)
            diff = (have != want).any(dim=2).any(dim=0)
            bad.update(int(i) for i in torch.nonzero(diff).flatten())
        return sorted(bad)

    def _state(self, key: bytes, t: torch.Tensor, salt: int) -> torch.Tensor:
        return _pattern([key], t[0].numel(), self._salt(salt), t.dtype)[0].view(t.shape[1:]).view(torch.uint8).to(t.device)

    def write_state(self, key: bytes, slot: int) -> None:
        """Write the state of the boundary whose last page key is ``key`` into ``slot``."""
        assert self.pools.mamba is not None
        for salt, t in enumerate(self.pools.mamba.tensors(), start=10):
            t.view(torch.uint8)[slot] = self._state(key, t, salt)

    def state_matches(self, key: bytes, slot: int) -> bool:
        assert self.pools.mamba is not None
        return all(torch.equal(t.view(torch.uint8)[slot], self._state(key, t, salt))
                   for salt, t in enumerate(self.pools.mamba.tensors(), start=10))

    def _page_tensors(self) -> list[tuple[int, torch.Tensor]]:
        # a state-only layout's KV tensor has no layers: its rows hold nothing to check
        out = [] if self.layout.state_only else [(1, self.pools.kv.tensor)]
        if self.pools.draft is not None:
            out.append((2, self.pools.draft.tensor))
        return out

    def _check_rows(self, keys: Sequence[bytes], rows: torch.Tensor) -> None:
        if rows.numel() != len(keys) * self.page:
            raise ValueError(f"{len(keys)} pages need {len(keys) * self.page} rows, got {rows.numel()}")

    def prefix_problems(self, linker: Linker, req: Request) -> list[str]:
        """What is wrong with the request's cached prefix: its rows and its state source
        must hold the content of its page keys (empty list: all good)."""
        keys = req.page_keys(req.prefix_pages)
        problems = [f"page {i}" for i in self.pages_match(keys, req.rows[: req.prefix_tokens])]
        if self.layout.is_hybrid and req.prefix_pages:
            if req.state_source is None:
                problems.append("no state source")
            elif not self.state_matches(keys[-1], req.state_source):
                problems.append(f"state at page {req.prefix_pages}")
        return problems


__all__ = ["PRESETS", "SyntheticContent", "preset_layout"]
