"""A request's isolation keys (salt, adapter, multimodal spans) in the Linker's page keys.

A salt or an adapter changes every page key; a multimodal span changes the keys of the pages
it overlaps and every later one, never an earlier one. Bad extra keys raise at the request,
naming the field, and leave nothing open. End to end with real forwards:
``test_isolation_e2e.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hylinker import Linker, LinkerConfig, MultimodalSpan
from hylinker.components.keys import (
    as_tokens,
    check_multimodal,
    namespace_seed,
    page_keys,
    request_seed,
)
from hylinker.components.pools import HybridPools
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.fakes import small_hybrid_layout

LAYOUT = small_hybrid_layout()
P = LAYOUT.page_size
SEED = namespace_seed(LAYOUT)


def toks(n: int, seed: int = 0) -> np.ndarray:
    return as_tokens(np.random.default_rng(seed).integers(1, 30000, size=n))


def keys(t: np.ndarray, *, salt: Any = None, adapter: Any = None,
         multimodal: tuple[MultimodalSpan, ...] = ()) -> list[bytes]:
    return page_keys(t, P, request_seed(SEED, salt=salt, adapter=adapter),
                     multimodal=check_multimodal(multimodal, len(t)))


# ---- key level ------------------------------------------------------------------------
def test_salts_and_adapters_change_every_page_key() -> None:
    t = toks(16 * P)
    variants: list[dict[str, Any]] = [
        {}, {"salt": "a"}, {"salt": "b"}, {"adapter": "a"}, {"adapter": "b"},
        {"salt": "a", "adapter": "a"}, {"salt": "a", "adapter": "b"}, {"salt": "b", "adapter": "a"},
        # a salt that spells another field's encoding is still only a salt
        {"salt": "a\x00adapter\x00b"},
    ]
    sets = [set(keys(t, **v)) for v in variants]
    for i, a in enumerate(sets):
        assert len(a) == 16
        for j in range(i + 1, len(sets)):
            assert not a & sets[j], (variants[i], variants[j])
    # the same keys again (positive control), and the deployment seed is the default
    assert keys(t, salt="a", adapter="b") == keys(t, salt=b"a", adapter="b")
    assert keys(t) == page_keys(t, P, SEED) == keys(t, salt="")


@pytest.mark.parametrize(("start", "end"), [
    (0, 1), (5, 9), (8, 12), (7, 17), (9, 40), (60, 64),
])
def test_span_changes_overlapping_and_later_pages_only(start: int, end: int) -> None:
    t = toks(16 * P)  # 16 pages of 4 tokens
    plain = keys(t)
    one = keys(t, multimodal=(MultimodalSpan(start, end, b"image-1"),))
    two = keys(t, multimodal=(MultimodalSpan(start, end, "image-2"),))
    first = start // P  # the first page the span overlaps
    assert one[:first] == plain[:first] == two[:first]  # pages before it: shared
    for i in range(first, 16):
        assert len({plain[i], one[i], two[i]}) == 3, i  # overlapping and every later page
    # the same content again gives the same keys; str is utf-8
    assert keys(t, multimodal=(MultimodalSpan(start, end, "image-1"),)) == one


def test_span_position_and_neighbours_count() -> None:
    t = toks(8 * P)
    a = keys(t, multimodal=(MultimodalSpan(4, 8, b"x"),))
    b = keys(t, multimodal=(MultimodalSpan(5, 8, b"x"),))  # the same pages, another range
    assert a[:1] == b[:1] and not set(a[1:]) & set(b[1:])
    both = keys(t, multimodal=(MultimodalSpan(4, 6, b"x"), MultimodalSpan(6, 8, b"y")))
    swapped = keys(t, multimodal=(MultimodalSpan(4, 6, b"y"), MultimodalSpan(6, 8, b"x")))
    assert not set(both[1:]) & set(swapped[1:])
    # a span in the trailing partial page changes no whole page's key
    t2 = toks(8 * P + 3)
    assert keys(t2, multimodal=(MultimodalSpan(8 * P, 8 * P + 2, b"x"),)) == keys(t2)


def test_keys_resume_from_a_page_with_spans() -> None:
    t = toks(12 * P)
    spans = (MultimodalSpan(6, 14, b"x"), MultimodalSpan(30, 33, b"y"))
    whole = page_keys(t, P, SEED, multimodal=spans)
    for k in range(1, 12):
        assert page_keys(t, P, whole[k - 1], start_page=k, multimodal=spans) == whole[k:]


BAD_REQUESTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"salt": 7}, TypeError, "salt"),
    ({"salt": ["a"]}, TypeError, "salt"),
    ({"adapter": 3}, TypeError, "adapter"),
    ({"adapter": b"lora"}, TypeError, "adapter"),
    ({"adapter": ""}, ValueError, "adapter"),
    ({"multimodal": MultimodalSpan(0, 4, b"x")}, TypeError, "multimodal"),
    ({"multimodal": [(0, 4, b"x")]}, TypeError, r"multimodal\[0\]"),
    ({"multimodal": [MultimodalSpan(8, 41, b"x")]}, ValueError, "outside the prompt"),
    ({"multimodal": [MultimodalSpan(0, 8, b"x"), MultimodalSpan(4, 12, b"y")]}, ValueError, "overlaps"),
    ({"multimodal": [MultimodalSpan(8, 12, b"x"), MultimodalSpan(0, 4, b"y")]}, ValueError, "sorted"),
]


@pytest.mark.parametrize(("args", "exc", "match"), [
    ((0, 4, 17), TypeError, "hash"),
    ((0, 4, b""), ValueError, "hash"),
    ((0, 4, None), TypeError, "hash"),
    ((4, 4, b"x"), ValueError, "no tokens"),
    ((-1, 4, b"x"), ValueError, "start"),
    ((True, 4, b"x"), TypeError, "start"),
    ((0, 4.0, b"x"), TypeError, "end"),
    ((0, "4", b"x"), TypeError, "end"),
])
def test_bad_span_is_refused(args: tuple[Any, Any, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        MultimodalSpan(*args)


async def test_bad_extra_keys_raise_at_the_request() -> None:
    store = EmbeddedStore(1 << 20)
    pools = HybridPools(LAYOUT, kv_pages=16, mamba_slots=4)
    try:
        async with Linker(LAYOUT, pools, store, LinkerConfig(resilience=None)) as linker:
            t = toks(40)
            for kwargs, exc, match in BAD_REQUESTS:
                with pytest.raises(exc, match=match):
                    linker.request("bad", t, **kwargs)
                with pytest.raises(exc, match=match):
                    async with linker.session("bad", t, **kwargs):
                        pass
            # nothing was registered: the id is free, a good request with spans opens
            async with linker.session("bad", t, multimodal=None) as req:
                assert req.multimodal == ()
            start_np: Any = np.int64(8)  # numpy ints are ints
            async with linker.session("bad", t, salt="s", adapter="lora-1",
                                      multimodal=[MultimodalSpan(start_np, 12, b"x")]) as req:
                assert req.multimodal == (MultimodalSpan(8, 12, b"x"),)
                await linker.lookup(req)
            linker.check_idle()
            assert linker.statistics().requests == 2  # the two good ones
    finally:
        await store.close()
