"""The deployment's identity in the plugin's keys (components/identity.py,
integrations/sglang/identity.py): the checkpoint's files at ``--model-path``, ``model_revision``,
the start-up LoRA adapters' files and the integrity level. A store written under one identity
is a miss under another; the same identity gives the same keys in another plugin instance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hylinker.tools.harness.sglang_cache import CacheSpec, SGLangCache, page_keys

A = list(range(1000, 1024))
C = list(range(3000, 3008))


def plugin(**extra: Any) -> dict[str, Any]:
    return {"linker": "HylinkerLinker", "linker_module_path": "hylinker.integrations.sglang",
            "linker_extra_config": extra}


def checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (root / "model.safetensors").write_bytes(b"\x01" * 9000)
    return root


def adapter(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def kv_keys(caches: list[SGLangCache], spec: CacheSpec, **extra: Any) -> list[str]:
    """The plugin's KV object keys of A's pages under ``spec``/``extra`` (a fresh plugin)."""
    cache = SGLangCache(spec, plugin(**extra))
    caches.append(cache)
    try:
        return cache.linker.object_keys("kv", page_keys(A, spec.page_size))
    finally:
        caches.remove(cache)
        cache.close()


@pytest.mark.mooncake
def test_a_store_written_before_a_checkpoint_update_misses_afterwards(
        caches: list[SGLangCache], mooncake_master: Any, tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "model")
    spec = CacheSpec(model_path=str(root))
    extra = {"store": "mooncake", "master": mooncake_master.address, "segment_mb": 16}

    def serve(prompt: list[int]) -> Any:
        cache = SGLangCache(spec, plugin(**extra))
        caches.append(cache)
        try:
            return cache.serve(prompt)
        finally:
            caches.remove(cache)
            cache.close()

    writer = SGLangCache(spec, plugin(**extra))  # its segment holds the objects: it stays up
    caches.append(writer)
    assert writer.serve(A).store_hit == 0
    again = serve(A + C)  # another plugin, the same files: restores A
    assert again.loaded == len(A) and again.restore_mismatches == [] and not again.aborted
    (root / "model.safetensors").write_bytes(b"\x01" * 9001)  # updated in place
    after = serve(A + C)
    assert (after.store_hit, after.loaded) == (0, 0)


def test_the_checkpoint_revision_and_integrity_level_are_in_the_keys(caches: list[SGLangCache],
                                                                     tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "model")
    spec = CacheSpec(model_path=str(root))
    base = kv_keys(caches, spec)
    assert kv_keys(caches, spec) == base  # same files, another plugin: the same keys
    assert kv_keys(caches, spec, integrity="header") != base
    assert kv_keys(caches, spec, model_revision="v2") != base
    (root / "config.json").write_text(json.dumps({"hidden_size": 64, "tie_word_embeddings": True}))
    assert kv_keys(caches, spec) != base


def test_adapters_of_the_same_name_and_other_files_get_other_keys(caches: list[SGLangCache],
                                                                  tmp_path: Path) -> None:
    one = adapter(tmp_path / "one", b"\x01" * 512)
    two = adapter(tmp_path / "two", b"\x02" * 512)
    keys_one = kv_keys(caches, CacheSpec(lora_paths=(("sql", str(one)),)))
    assert kv_keys(caches, CacheSpec(lora_paths=(("sql", str(one)),))) == keys_one
    assert kv_keys(caches, CacheSpec(lora_paths=(("sql", str(two)),))) != keys_one
    (one / "adapter_model.safetensors").write_bytes(b"\x03" * 512)  # retrained in place: same name, path, size
    assert kv_keys(caches, CacheSpec(lora_paths=(("sql", str(one)),))) != keys_one
