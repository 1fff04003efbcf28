"""The vLLM connector's extra-key encoding and chained keys (no vLLM needed): a block's key
changes exactly where its extra keys do, and anything the encoding cannot describe is refused."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from hylinker.integrations.vllm.plan import (
    BlockKeys,
    UnkeyableRequest,
    encode_extra_keys,
    fold_extra_keys,
    geometry_seed,
    request_seed,
)

BS = 4
SEED = geometry_seed("m", "g", "")
TOKENS = list(range(10, 26))  # 4 blocks


def keys_with(extras: Mapping[int, tuple[tuple[object, ...], ...]], seed: bytes = SEED) -> list[bytes]:
    return BlockKeys(seed, BS, lambda i: encode_extra_keys(extras[i]) if i in extras else None).extend(TOKENS)


def test_blocks_without_extra_keys_keep_the_plain_keys() -> None:
    plain = BlockKeys(SEED, BS).extend(TOKENS)
    assert len(plain) == 4
    assert keys_with({}) == plain


@pytest.mark.parametrize("extras", [
    {0: (("cache_salt", "A"),)},
    {1: (("mm", "img-x", 2),)},
    {2: (("prompt_embeds", b"\x01" * 32),)},
    {0: (("lora", "a1", "/p"),), 1: (("lora", "a1", "/p"),), 2: (("lora", "a1", "/p"),), 3: (("lora", "a1", "/p"),)},
])
def test_a_blocks_extra_keys_change_its_key_and_every_key_after_it(
        extras: dict[int, tuple[tuple[object, ...], ...]]) -> None:
    plain = BlockKeys(SEED, BS).extend(TOKENS)
    got = keys_with(extras)
    first = min(extras)
    assert got[:first] == plain[:first]  # blocks before it are shared
    assert all(a != b for a, b in zip(got[first:], plain[first:], strict=True))
    assert keys_with(extras) == got  # deterministic


def test_extra_key_values_that_differ_give_different_keys() -> None:
    variants: list[Mapping[int, tuple[tuple[object, ...], ...]]]
    variants = [{0: (("cache_salt", s),)} for s in ("A", "B", "a", "A ")]
    variants += [{1: (("mm", "x", 0),)}, {1: (("mm", "y", 0),)}, {1: (("mm", "x", 1),)},
                 {1: (("mm", "x", 0), ("mm", "y", 3))}]
    variants += [{0: (("lora", "a1", "/p"),)}, {0: (("lora", "a1", "/q"),)}, {0: (("lora", "a2", "/p"),)}]
    last = [keys_with(v)[-1] for v in variants]
    assert len(set(last)) == len(variants)
    # an encoding is unambiguous: a string is not its bytes, nor an integer its digits
    assert encode_extra_keys((("mm", "1", 0),)) != encode_extra_keys((("mm", 1, 0),))
    assert encode_extra_keys((("mm", "ab", "c"),)) != encode_extra_keys((("mm", "a", "bc"),))
    assert encode_extra_keys((("prompt_embeds", b"ab"),)) != encode_extra_keys((("prompt_embeds", "ab"),))


def test_the_request_seed_folds_request_wide_parts() -> None:
    assert request_seed(SEED, []) == SEED
    a = request_seed(SEED, [("lora", "a1", "/p", b"\x00" * 32)])
    b = request_seed(SEED, [("lora", "a1", "/p", b"\x01" * 32)])  # same name and path, other weights
    assert len({SEED, a, b}) == 3
    assert fold_extra_keys(SEED, b"x") != fold_extra_keys(SEED, b"y")


@pytest.mark.parametrize("keys", [
    (("adapter_v2", "x"),),  # a kind this connector does not know
    ("lora",),  # not a tuple
    ((),),
    (("cache_salt", 5.0),),  # a value of a type the encoding does not know
    (("cache_salt", None),),
    (("mm", ("nested",), 0),),
    (("mm", True, 0),),
])
def test_what_the_encoding_cannot_describe_is_refused(keys: tuple[object, ...]) -> None:
    with pytest.raises(UnkeyableRequest):
        encode_extra_keys(keys)  # type: ignore[arg-type]


def test_a_refusal_stops_the_keys_at_the_block_before() -> None:
    def extras(i: int) -> bytes | None:
        if i == 2:
            raise UnkeyableRequest("block 2")
        return None

    keys = BlockKeys(SEED, BS, extras)
    with pytest.raises(UnkeyableRequest):
        keys.extend(TOKENS)
    assert keys.keys == BlockKeys(SEED, BS).extend(TOKENS)[:2]
