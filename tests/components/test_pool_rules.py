"""Per-pool rules: which pages a pool stores for a node and probes at a boundary."""

from __future__ import annotations

import torch

from hylinker.components.keys import namespace_seed, object_key, page_keys
from hylinker.components.layout import PoolKind
from hylinker.components.pool_rules import AllPages, TrailingState, pool_rules
from hylinker.components.pools import HybridPools
from hylinker.components.radix import RadixTree
from hylinker.testing.fakes import small_hybrid_layout


def test_rules_per_pool() -> None:
    layout = small_hybrid_layout()
    rules = pool_rules(layout)
    assert list(rules) == list(layout.pools)
    assert isinstance(rules[PoolKind.MAMBA], TrailingState)
    assert isinstance(rules[PoolKind.FULL], AllPages) and isinstance(rules[PoolKind.DRAFT], AllPages)
    # a tail of 5 pages starting at absolute page 3, grid of 2 pages: states at pages 3 and 5
    assert rules[PoolKind.MAMBA].probe_positions(3, 5, 2) == [0, 2, 4]
    assert rules[PoolKind.FULL].probe_positions(3, 5, 2) == [0, 1, 2, 3, 4]


def test_node_objects_and_pages() -> None:
    layout = small_hybrid_layout()
    pools = HybridPools(layout, kv_pages=8, mamba_slots=2)
    seed = namespace_seed(layout)
    tree = RadixTree(layout, pools, seed)
    tokens = torch.arange(1, 17, dtype=torch.int32).numpy()
    keys = page_keys(tokens, layout.page_size, seed)
    rows = pools.kv.alloc_rows(len(keys))
    slot = pools.mamba.slots.alloc(1)  # type: ignore[union-attr]
    assert rows is not None and slot is not None
    node = tree.insert(keys, rows, slot[0], owned_from=0).node
    rules = pool_rules(layout)
    assert list(rules[PoolKind.FULL].pages(node)) == list(range(node.start_page, node.end_page))
    assert list(rules[PoolKind.MAMBA].pages(node)) == [node.end_page - 1]
    names, index = rules[PoolKind.MAMBA].node_objects([node])
    assert names == [object_key(keys[-1], PoolKind.MAMBA, layout)] and index.tolist() == [[slot[0]]]
    names, index = rules[PoolKind.FULL].node_objects([node])
    assert len(names) == len(keys) and torch.equal(index.reshape(-1), rows)
    assert rules[PoolKind.MAMBA].touch_names(keys, node) == [object_key(keys[-1], PoolKind.MAMBA, layout)]
    # a load with a fallback state at page 2 and the deepest at page 4
    names, index = rules[PoolKind.MAMBA].load_objects(keys, rows, [(2, 0), (4, 1)])
    assert names == [object_key(keys[1], PoolKind.MAMBA, layout), object_key(keys[3], PoolKind.MAMBA, layout)]
    assert index.tolist() == [[0], [1]]
    names, index = rules[PoolKind.FULL].load_objects(keys, rows, [(4, 1)])
    assert len(names) == len(keys) and index.shape == (len(keys), layout.page_size)
    assert rules[PoolKind.MAMBA].stored_by_commit(True, False) is False
    assert rules[PoolKind.FULL].stored_by_commit(True, False) is True
    tree.reset()
