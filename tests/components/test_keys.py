"""Page keys: chained, whole pages only, salted namespaces, object keys, token validation."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pytest
import torch

from hylinker.components.keys import (
    KEY_BYTES,
    MAX_TOKEN_ID,
    TokenError,
    as_tokens,
    namespace_seed,
    object_key,
    page_keys,
)
from hylinker.components.layout import ModelLayout, PoolKind

P = 16


def layout(**over: Any) -> ModelLayout:
    kw: dict[str, Any] = {
        "page_size": P, "chunk_size": 64, "full_layers": [0, 1], "kv_row_shape": (8,),
        "mamba_layers": [{"layer_id": 2, "conv_shape": (3, 8), "conv_dtype": "float32",
                          "temporal_shape": (4, 4), "temporal_dtype": "float32"}],
        "draft_layers": 1, "draft_row_shape": (8,), "tp_size": 4,
    }
    kw.update(over)
    return ModelLayout.create(**kw)


LAYOUT = layout()
SEED = namespace_seed(LAYOUT)


def prompt(n: int, start: int = 0) -> np.ndarray:
    return as_tokens(np.arange(start, start + n) % 50_000 + 7)


def test_known_answer_first_two_pages() -> None:
    # The documented construction, computed independently: BLAKE2b-128 over int32 LE ids.
    toks = prompt(2 * P)
    k0 = hashlib.blake2b(SEED + struct.pack(f"<{P}i", *toks[:P].tolist()), digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + struct.pack(f"<{P}i", *toks[P:].tolist()), digest_size=16).digest()
    assert page_keys(toks, P, SEED) == [k0, k1]
    assert all(len(k) == KEY_BYTES for k in (k0, k1))


def test_seed_known_answer() -> None:
    h = hashlib.blake2b(digest_size=16)
    h.update(LAYOUT.fingerprint)
    assert namespace_seed(LAYOUT) == h.digest()


def test_same_prefix_same_keys() -> None:
    a = prompt(10 * P)
    b = np.concatenate([a[: 6 * P], prompt(4 * P, start=999)])
    ka, kb = page_keys(a, P, SEED), page_keys(as_tokens(b), P, SEED)
    assert ka[:6] == kb[:6]
    assert all(x != y for x, y in zip(ka[6:], kb[6:]))


@pytest.mark.parametrize("page", [0, 1, 4, 7])
@pytest.mark.parametrize("offset", [0, 5, P - 1])
def test_change_in_page_i_changes_keys_from_i_on(page: int, offset: int) -> None:
    a = prompt(8 * P)
    b = a.copy()
    b[page * P + offset] += 1
    ka, kb = page_keys(a, P, SEED), page_keys(b, P, SEED)
    assert ka[:page] == kb[:page]
    assert all(x != y for x, y in zip(ka[page:], kb[page:]))
    assert len(set(ka) | set(kb)) == 8 + (8 - page)


@pytest.mark.parametrize(("n_tokens", "n_keys"), [(0, 0), (1, 0), (P - 1, 0), (P, 1), (P + 1, 1),
                                                  (3 * P - 1, 2), (3 * P, 3), (3 * P + 5, 3)])
def test_trailing_partial_page_has_no_key(n_tokens: int, n_keys: int) -> None:
    toks = prompt(n_tokens)
    keys = page_keys(toks, P, SEED)
    assert len(keys) == n_keys
    assert keys == page_keys(prompt(n_keys * P), P, SEED)


def test_start_page_and_max_pages_continue_the_chain() -> None:
    toks = prompt(9 * P + 3)
    full = page_keys(toks, P, SEED)
    assert len(full) == 9
    for start in range(1, 9):
        assert page_keys(toks, P, full[start - 1], start_page=start) == full[start:]
        for m in (0, 1, 3, 100):
            assert page_keys(toks, P, full[start - 1], start_page=start, max_pages=m) == full[start:start + m]
    assert page_keys(toks, P, SEED, max_pages=4) == full[:4]


def test_page_size_changes_keys() -> None:
    toks = prompt(64)
    assert not set(page_keys(toks, 16, SEED)) & set(page_keys(toks, 32, SEED))


# ---- salts and namespaces ------------------------------------------------------------
def test_salts_separate_namespaces() -> None:
    toks = prompt(32 * P)
    salts: list[bytes | str | None] = [None, "tenant-a", "tenant-b", b"tenant-c", "\x00", "tenant-a\x00"]
    key_sets = [set(page_keys(toks, P, namespace_seed(LAYOUT, s))) for s in salts]
    for i in range(len(salts)):
        assert len(key_sets[i]) == 32
        for j in range(i + 1, len(salts)):
            assert not key_sets[i] & key_sets[j], (salts[i], salts[j])


@pytest.mark.parametrize(("a", "b", "same"), [
    (None, "", True),  # an empty salt is no salt
    ("x", b"x", True),  # str salts are utf-8
    ("é", "é".encode(), True),
    (None, "x", False),
    ("x", "y", False),
    ("x", "xx", False),
])
def test_seed_salt_equivalences(a: Any, b: Any, same: bool) -> None:
    assert (namespace_seed(LAYOUT, a) == namespace_seed(LAYOUT, b)) is same


def test_layout_changes_seed_but_rank_does_not() -> None:
    assert namespace_seed(layout(kv_row_shape=(16,))) != SEED
    assert namespace_seed(layout(tp_rank=3)) == SEED


# ---- object keys ---------------------------------------------------------------------
KEY = bytes(range(16))


@pytest.mark.parametrize(("over", "pool", "expected"), [
    ({}, PoolKind.FULL, f"{KEY.hex()}:kv:tp0"),
    ({"tp_rank": 3}, PoolKind.FULL, f"{KEY.hex()}:kv:tp3"),
    ({"tp_rank": 3}, PoolKind.MAMBA, f"{KEY.hex()}:mamba:tp3"),
    ({"tp_rank": 3}, PoolKind.DRAFT, f"{KEY.hex()}:draft:tp3"),
    ({"tp_rank": 3, "replicated": ["mamba"]}, PoolKind.MAMBA, f"{KEY.hex()}:mamba:rep"),
    ({"tp_rank": 3, "replicated": ["mamba"]}, PoolKind.FULL, f"{KEY.hex()}:kv:tp3"),
    ({"tp_rank": 1, "replicated": ["kv", "draft"]}, PoolKind.DRAFT, f"{KEY.hex()}:draft:rep"),
    ({"tp_rank": 3, "dcp_rank": 1, "dcp_size": 2}, PoolKind.FULL, f"{KEY.hex()}:kv:tp3dcp1"),
    ({"tp_rank": 3, "dcp_rank": 1, "dcp_size": 2}, PoolKind.DRAFT, f"{KEY.hex()}:draft:tp3dcp1"),
    ({"tp_rank": 3, "dcp_rank": 1, "dcp_size": 2}, PoolKind.MAMBA, f"{KEY.hex()}:mamba:tp3"),
])
def test_object_key_format(over: dict[str, Any], pool: PoolKind, expected: str) -> None:
    assert object_key(KEY, pool, layout(**over)) == expected


@pytest.mark.parametrize("pool", list(PoolKind))
def test_object_keys_differ_by_rank_unless_replicated(pool: PoolKind) -> None:
    per_rank = {object_key(KEY, pool, layout(tp_rank=r)) for r in range(4)}
    assert len(per_rank) == 4
    assert all(f"tp{r}" in k for r, k in enumerate(sorted(per_rank)))
    replicated = {object_key(KEY, pool, layout(tp_rank=r, replicated=[pool])) for r in range(4)}
    assert len(replicated) == 1 and "tp" not in next(iter(replicated))


def test_object_keys_of_pools_differ() -> None:
    assert len({object_key(KEY, p, LAYOUT) for p in PoolKind}) == len(PoolKind)


# ---- token validation ----------------------------------------------------------------
BAD_TOKENS: list[tuple[str, Any]] = [
    ("2-D list", [[1, 2], [3, 4]]),
    ("2-D array", np.zeros((2, 16), dtype=np.int32)),
    ("scalar", 5),
    ("floats", [1.0, 2.0]),
    ("float array", np.arange(4, dtype=np.float32)),
    ("float tensor", torch.arange(4, dtype=torch.float32)),
    ("bool", [True, False]),
    ("negative", [1, -1, 3]),
    ("negative int8", np.array([-1], dtype=np.int8)),
    ("too large", [0, 2**31]),
    ("too large uint64", np.array([2**63], dtype=np.uint64)),
    ("huge python int", [2**70]),
    ("strings", ["a", "b"]),
    ("None inside", [1, None]),
    ("ragged", [[1], [2, 3]]),
]


@pytest.mark.parametrize("tokens", [t for _, t in BAD_TOKENS], ids=[c for c, _ in BAD_TOKENS])
def test_bad_token_ids_raise(tokens: Any) -> None:
    with pytest.raises(TokenError):
        as_tokens(tokens)


def test_token_error_is_a_value_error() -> None:
    assert issubclass(TokenError, ValueError)


@pytest.mark.parametrize("tokens", [
    [0, 1, MAX_TOKEN_ID],
    np.array([0, 1, MAX_TOKEN_ID], dtype=np.int64),
    np.array([0, 1, MAX_TOKEN_ID], dtype=">i4"),
    np.array([0, 1, MAX_TOKEN_ID], dtype=np.uint32),
    torch.tensor([0, 1, MAX_TOKEN_ID]),
    np.array([0, 5, 1, 7, MAX_TOKEN_ID])[::2],
    (0, 1, MAX_TOKEN_ID),
], ids=["list", "int64", "big-endian", "uint32", "torch", "strided", "tuple"])
def test_good_token_ids_in_any_spelling_give_the_same_array(tokens: Any) -> None:
    arr = as_tokens(tokens)
    assert arr.dtype == np.dtype("<i4") and arr.flags.c_contiguous
    assert arr.tolist() == [0, 1, MAX_TOKEN_ID]


def test_spellings_give_the_same_keys() -> None:
    ids = list(range(100, 100 + 4 * P))
    ref = page_keys(as_tokens(ids), P, SEED)
    for spelling in (np.array(ids, dtype=">i8"), torch.tensor(ids), tuple(ids)):
        assert page_keys(as_tokens(spelling), P, SEED) == ref  # type: ignore[arg-type]


def test_empty_tokens() -> None:
    arr = as_tokens([])
    assert arr.dtype == np.dtype("<i4") and arr.size == 0
    assert page_keys(arr, P, SEED) == []


@pytest.mark.parametrize("tokens", [
    np.arange(4 * P, dtype=np.int64),
    np.arange(4 * P, dtype=">i4"),
    np.arange(8 * P, dtype=np.int32)[::2],
    np.arange(4 * P, dtype=np.int32).reshape(4, P),
], ids=["int64", "big-endian", "strided", "2-D"])
def test_page_keys_refuses_unvalidated_arrays(tokens: np.ndarray) -> None:
    # Hashing the raw bytes of another dtype would silently give keys no other caller can match.
    with pytest.raises(TokenError):
        page_keys(tokens, P, SEED)
