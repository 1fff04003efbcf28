"""SGLang's request namespace in the plugin's objects: ``extra_key`` (a LoRA adapter's id is part
of it), ``cache_salt``, and image pad values, on SGLang 0.5.23's real UnifiedRadixCache on CPU.

SGLang keys its tree and its storage pages by the namespace (``RadixKey.extra_key`` /
``cache_salt``; ``get_storage_hash_str`` seeds the page chain from
``storage_namespace_seed(extra_key, cache_salt)``; ``Req`` appends ``lora_id`` to ``extra_key``;
an image's placeholder tokens are replaced by pad values derived from the image's hash). The
plugin names its objects ``{SGLang page key}{suffix}``, so two namespaces never share an object.
The synthetic forward's bytes depend on the namespace (tools/harness/sglang_cache.py), so a restore
from another namespace's objects would also show as a byte mismatch. Each negative has its
positive control: the same namespace after a flush restores byte for byte.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

PLUGIN = {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang",
          "linker_extra_config": {}}
A = list(range(1000, 1024))
B = list(range(2000, 2016))
C = list(range(3000, 3008))

OWNER: dict[str, Any] = {"extra_key": "tenant-a", "cache_salt": "salt-1"}
OTHERS: list[dict[str, Any]] = [
    {},  # no namespace at all
    {"extra_key": "tenant-b", "cache_salt": "salt-1"},
    {"extra_key": "tenant-a", "cache_salt": "salt-2"},
    {"extra_key": "tenant-a"},
    {"cache_salt": "salt-1"},
    {"extra_key": "tenant-a", "cache_salt": "salt-1", "lora_id": "lora-1"},  # an adapter
    {"cache_salt": "salt-1", "lora_id": "lora-2"},
]


def namespace(kw: dict[str, Any]) -> dict[str, Any]:
    """The RadixKey namespace SGLang's ``Req`` builds (``lora_id`` appended to ``extra_key``)."""
    extra = kw.get("extra_key")
    if "lora_id" in kw:
        extra = (extra or "") + kw["lora_id"]
    return {"extra_key": extra, "cache_salt": kw.get("cache_salt")}


def kv_objects(cache: SGLangCache, tokens: list[int], kw: dict[str, Any]) -> list[str]:
    return cache.linker.object_keys("kv", page_keys(tokens, cache.spec.page_size, **namespace(kw)))


def present(cache: SGLangCache, keys: list[str]) -> list[bool]:
    store = cache.linker.store
    return list(cache.linker.data.call_store(store.exists, keys).result(timeout=10))


def test_sglang_keys_carry_the_request_namespace() -> None:
    """SGLang's own key functions: a namespace seeds the whole chain; none leaves it unseeded."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.utils import storage_namespace_seed
    from sglang.srt.sampling.sampling_params import SamplingParams

    assert storage_namespace_seed(None, None) is None
    req = Req(rid="r", origin_input_text="", origin_input_ids=array("q", A),
              sampling_params=SamplingParams(), extra_key="tenant-a", lora_id="lora-1")
    assert req.extra_key == "tenant-alora-1"
    chains = [set(page_keys(A + B, **namespace(kw))) for kw in [OWNER, *OTHERS]]
    for i, keys in enumerate(chains):
        assert len(keys) == len(A + B)
        for j in range(i + 1, len(chains)):
            assert not keys & chains[j], (i, j)
    assert page_keys(A + B, **namespace(OWNER)) == page_keys(A + B, **namespace(dict(OWNER)))


@pytest.mark.parametrize("core", ["python", "rust"])
def test_namespaces_never_share_an_object(caches: list[SGLangCache], core: str) -> None:
    """The owner's prompts X (for the device pass) and Y (for the store pass): no other namespace
    matches them on the device or in the store; after a flush each namespace restores its own."""
    cache = SGLangCache(CacheSpec(tree_core=core), PLUGIN)
    caches.append(cache)
    X, Y = A + B, B + A
    for prompt in (X, Y):
        assert cache.serve(prompt, **OWNER).store_hit == 0
    mine = kv_objects(cache, X, OWNER)
    assert all(present(cache, mine))  # the plugin writes under SGLang's namespaced page keys
    assert not any(present(cache, kv_objects(cache, X, {})))
    # X is on the device and in the store: no other namespace matches it there
    for kw in OTHERS:
        other = cache.serve(X, **kw)
        assert (other.device_hit, other.store_hit, other.loaded) == (0, 0, 0), kw
    objects = [set(kv_objects(cache, X, kw)) for kw in [OWNER, *OTHERS]]
    for i, keys in enumerate(objects):
        assert all(present(cache, sorted(keys)))
        for j in range(i + 1, len(objects)):
            assert not keys & objects[j]
    cache.flush()
    # Y is in the store only, under the owner's namespace alone
    for kw in [*OTHERS, {"extra_key": "tenant-z"}]:
        other = cache.serve(Y + C, **kw)
        assert (other.device_hit, other.store_hit, other.loaded) == (0, 0, 0), kw
    cache.flush()
    # positive controls: each namespace restores its own prefix from the store, byte for byte
    for prompt, kw in [(Y, OWNER), *((X, kw) for kw in [OWNER, *OTHERS])]:
        again = cache.serve(prompt + C, **kw)
        assert again.device_hit == 0 and not again.aborted, kw
        assert again.loaded == len(prompt), (kw, again)
        assert again.restore_mismatches == [], kw
        cache.flush()
    assert cache.linker.statistics().verify_failures == 0


def test_another_image_shares_only_the_text_before_it(caches: list[SGLangCache]) -> None:
    """Two images behind the same placeholder tokens: SGLang pads them with values derived from
    each image's hash (``pad_mm_tokens``), so only the text before the image is shared."""
    from sglang.srt.managers.mm_utils import pad_mm_tokens
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs

    image_token = 7
    text, tail = A[:12], B[:8]
    raw = text + [image_token] * 8 + tail

    def padded(image_hash: int) -> list[int]:
        item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[(len(text), len(text) + 7)])
        item.set_hash(image_hash)
        return list(pad_mm_tokens(array("q", raw), MultimodalInputs(mm_items=[item], im_token_id=image_token)))

    one, two, three = padded(0x1111), padded(0x2222), padded(0x3333)
    image = slice(len(text), len(raw) - len(tail))
    assert one[:len(text)] == two[:len(text)] and one[image] != two[image]
    cache = SGLangCache(CacheSpec(model="dense", page_size=4, num_layers=2), PLUGIN)
    caches.append(cache)
    first = cache.serve(one)
    assert first.store_hit == 0
    cache.flush()
    other = cache.serve(two + C[:4])  # from the store: the text before the image only
    assert other.device_hit == 0 and other.loaded == len(text) and other.restore_mismatches == []
    on_device = cache.serve(three + C)  # SGLang's own tree, no flush: the text only
    assert on_device.device_hit == len(text) and on_device.store_hit == 0
    cache.flush()
    same = cache.serve(one + C)  # positive control: the same image restores everything
    assert same.device_hit == 0 and same.loaded == len(one) and same.restore_mismatches == []
