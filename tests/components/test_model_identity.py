"""The model's identity in every key (components/identity.py): the checkpoint's files, the
operator's ``model_revision`` and the integrity level. A store written under one identity is a
miss under another; the same files give the same keys in every process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

from hylinker.components.identity import (
    checkpoint_fingerprint,
    model_identity,
    namespace_term,
    resolve_checkpoint,
)
from hylinker.components.layout import ModelLayout
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill

TOKENS = np.random.default_rng(0).integers(1, 30000, size=48).astype(np.int32)


def checkpoint(root: Path) -> Path:
    """A small checkpoint: a config, a safetensors index and two weight shards."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4}))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (root / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 512)
    (root / "model-00002-of-00002.safetensors").write_bytes(b"\x07" * 70000)
    return root


async def stored_tokens(store: EmbeddedStore, layout: ModelLayout, config: LinkerConfig, *,
                        donate: bool) -> int:
    """Donate the first 41 of TOKENS through a Linker (``donate``: 40 stored), or look TOKENS up
    in a fresh one: the tokens the store would restore."""
    pools = HybridPools(layout, kv_pages=32, mamba_slots=8)
    async with Linker(layout, pools, store, config) as lk:
        req = lk.request("r", TOKENS[:41] if donate else TOKENS)
        hit = await lk.lookup(req)
        if donate:
            await synthetic_prefill(lk, SyntheticContent(pools), req)
        await lk.release(req)
        await lk.drain()
    return hit.store_tokens


def layout_of(path: Path | str) -> ModelLayout:
    return attrs.evolve(small_hybrid_layout(), model_name=str(path))


# ---- the fingerprint ------------------------------------------------------------------------


@pytest.mark.parametrize("change", ["weight-size", "weight-name", "config", "same-size-weights", "index"])
def test_a_changed_checkpoint_changes_its_fingerprint(tmp_path: Path, change: str) -> None:
    root = checkpoint(tmp_path / "m")
    before = checkpoint_fingerprint(root)
    assert checkpoint_fingerprint(root) == before
    shard = root / "model-00002-of-00002.safetensors"
    if change == "weight-size":
        shard.write_bytes(b"\x07" * 70001)
    elif change == "weight-name":
        shard.rename(root / "model-00002-of-00002.bin")
    elif change == "config":
        (root / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4, "x": 1}))
    elif change == "same-size-weights":  # a retrain that keeps every size: the samples see it
        shard.write_bytes(b"\x08" * 70000)
    else:
        (root / "model.safetensors.index.json").write_text("{}")
    assert checkpoint_fingerprint(root) != before


def test_download_metadata_and_the_directory_path_do_not_count(tmp_path: Path) -> None:
    a, b = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b")
    (b / ".cache").mkdir()
    (b / ".cache" / "download.metadata").write_text("fetched at 12:00")
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)


def test_the_same_files_give_the_same_term_in_another_process(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m")
    here = namespace_term(model_identity(str(root), "r1"), "checksum").hex()
    code = ("import sys; from hylinker.components.identity import model_identity, namespace_term; "
            "print(namespace_term(model_identity(sys.argv[1], 'r1'), 'checksum').hex())")
    there = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True,
                           check=True, timeout=120).stdout.strip()
    assert there == here
    assert namespace_term(model_identity(str(root), "r2"), "checksum").hex() != here
    assert namespace_term(model_identity(str(root), "r1"), "header").hex() != here


def test_a_hub_name_resolves_through_the_hub_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--org--model"
    checkpoint(repo / "snapshots" / "abc123")
    checkpoint(repo / "snapshots" / "def456")
    (repo / "snapshots" / "def456" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_checkpoint("org/model", cache=cache) == (repo / "snapshots" / "abc123", "hub cache")
    assert resolve_checkpoint("org/model", "def456", cache=cache) == (repo / "snapshots" / "def456", "hub cache")
    main = model_identity("org/model", cache=cache)
    assert main.source == "hub cache"
    assert main.weights == checkpoint_fingerprint(repo / "snapshots" / "abc123")
    assert model_identity("org/model", "def456", cache=cache).weights != main.weights
    with caplog.at_level(logging.WARNING, "hylinker.components.identity"):
        missing = model_identity("org/other", "v2", cache=cache)
    assert (missing.source, missing.weights) == ("name", b"")
    assert "org/other" in caplog.text and "model_revision" in caplog.text
    # name-only identities still differ by revision
    assert missing.term() != model_identity("org/other", "v3", cache=cache).term()


# ---- the library: a store written before an update misses afterwards --------------------------


@pytest.mark.parametrize("change", ["weight-size", "weight-name", "config"])
async def test_a_linker_misses_objects_of_the_checkpoint_before_an_update(tmp_path: Path, change: str) -> None:
    root = checkpoint(tmp_path / "m")
    layout, store, config = layout_of(root), EmbeddedStore(8 << 20), LinkerConfig()
    assert await stored_tokens(store, layout, config, donate=True) == 0
    assert await stored_tokens(store, layout, config, donate=False) == 40  # same files: a hit
    shard = root / "model-00001-of-00002.safetensors"
    if change == "weight-size":
        shard.write_bytes(shard.read_bytes() + b"\0")
    elif change == "weight-name":
        shard.rename(root / "model-00001-of-00002.renamed")
    else:
        (root / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 5}))
    assert await stored_tokens(store, layout, config, donate=False) == 0


async def test_model_path_and_model_revision_name_the_weights(tmp_path: Path) -> None:
    a, b = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b")
    (b / "config.json").write_text("{}")
    layout, store = small_hybrid_layout(), EmbeddedStore(8 << 20)
    await stored_tokens(store, layout, LinkerConfig(model_path=str(a), model_revision="r1"), donate=True)
    assert await stored_tokens(store, layout, LinkerConfig(model_path=str(a), model_revision="r1"),
                               donate=False) == 40
    assert await stored_tokens(store, layout, LinkerConfig(model_path=str(a), model_revision="r2"),
                               donate=False) == 0
    assert await stored_tokens(store, layout, LinkerConfig(model_path=str(b), model_revision="r1"),
                               donate=False) == 0


async def test_engines_at_different_integrity_levels_never_share_an_object() -> None:
    layout, store = small_hybrid_layout(), EmbeddedStore(8 << 20)
    await stored_tokens(store, layout, LinkerConfig(integrity="header"), donate=True)
    assert await stored_tokens(store, layout, LinkerConfig(integrity="header"), donate=False) == 40
    assert await stored_tokens(store, layout, LinkerConfig(integrity="checksum"), donate=False) == 0
