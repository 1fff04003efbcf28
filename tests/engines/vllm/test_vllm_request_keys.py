"""The connector's block keys against vLLM 0.32's own block hashes, with vLLM's real ``Request``,
``LoRARequest`` and ``MultiModalFeatureSpec`` objects through the connector's real scheduler side
(no engine, no forward): two requests share a key exactly where vLLM's own hashes agree; keys do
not depend on vLLM's per-process hash seed; a request whose keys cannot be described is served
without the store, counted."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256, xxhash
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from hylinker.integrations.vllm import request_keys as vllm_request_keys
from hylinker.integrations.vllm.connector import (
    HylinkerConnector,
    HylinkerConnectorMetadata,
    HylinkerWorkerMetadata,
)
from hylinker.integrations.vllm.index import RankReport
from hylinker.integrations.vllm.metrics import HylinkerStats
from hylinker.integrations.vllm.plan import geometry_seed
from hylinker.integrations.vllm.request_keys import request_block_keys

BS = 16
N_TOKENS = 8 * BS + 5  # 8 whole blocks; a hit can cover all 8
TOKENS = [(7 * i) % 251 + 3 for i in range(N_TOKENS)]
SEED = geometry_seed("tiny", "geometry", "")
IMAGE = PlaceholderRange(offset=2 * BS + 3, length=3 * BS)  # blocks 2..5
_ids = itertools.count()


@pytest.fixture(autouse=True)
def sha256_none_hash() -> Iterator[None]:
    init_none_hash(sha256)
    yield
    init_none_hash(sha256)


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    for name, fill in (("a1", 1), ("a2", 2), ("a1-copy", 1)):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text('{"r": 8}')
        (d / "adapter_model.safetensors").write_bytes(bytes([fill]) * 64)
    return {n: tmp_path / n for n in ("a1", "a2", "a1-copy")}


def image(identifier: str, where: PlaceholderRange = IMAGE) -> list[MultiModalFeatureSpec]:
    return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier, mm_position=where)]


def make(tokens: list[int] | None = TOKENS, *, embeds: torch.Tensor | None = None, hashed: bool = True,
         **kw: Any) -> Request:
    """A request as vLLM's engine core builds it (``hashed``: with vLLM's own block hasher)."""
    return Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=4), None, prompt_embeds=embeds,
                   block_hasher=get_request_block_hasher(BS, sha256) if hashed else None, **kw)


def ours(request: Request) -> list[bytes]:
    return request_block_keys(SEED, BS, request).extend(request.all_token_ids)


def test_keys_agree_exactly_where_vllms_own_block_hashes_agree(adapters: dict[str, Path]) -> None:
    lora = {n: LoRARequest(n.split("-")[0], 1 + i, str(p)) for i, (n, p) in enumerate(adapters.items())}
    variants = {
        "plain": make(), "salt-A": make(cache_salt="A"), "salt-A-again": make(cache_salt="A"),
        "salt-B": make(cache_salt="B"), "salt-empty": make(cache_salt=""),
        "lora-a1": make(lora_request=lora["a1"]), "lora-a2": make(lora_request=lora["a2"]),
        "lora-a1-other-path": make(lora_request=lora["a1-copy"]),
        "image-x": make(mm_features=image("x")), "image-x-again": make(mm_features=image("x")),
        "image-y": make(mm_features=image("y")),
        "image-x-later": make(mm_features=image("x", PlaceholderRange(offset=IMAGE.offset + 1, length=IMAGE.length))),
        "image-x-salt-A": make(mm_features=image("x"), cache_salt="A"),
    }
    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(N_TOKENS, 8, generator=g)
    e2 = e1.clone()
    e2[3 * BS + 1, 0] += 1.0  # differs in block 3 only
    embeds = {"embeds-1": make(None, embeds=e1), "embeds-1-again": make(None, embeds=e1.clone()),
              "embeds-2": make(None, embeds=e2)}
    compared = 0
    for family in (variants, embeds):
        keys = {n: ours(r) for n, r in family.items()}
        hashes = {n: list(r.block_hashes) for n, r in family.items()}
        for u, v in itertools.combinations(family, 2):
            assert len(keys[u]) == len(hashes[u]) == 8
            for i in range(8):
                assert (keys[u][i] == keys[v][i]) == (hashes[u][i] == hashes[v][i]), (u, v, i)
                compared += 1
    # the cases that matter, named: vLLM (and so the connector) shares blocks before an image and
    # before the block whose embeddings differ, nothing across salts or adapters
    k = {n: ours(r) for n, r in variants.items()}
    assert k["image-x"][:2] == k["image-y"][:2] == k["plain"][:2] and k["image-x"][2] != k["image-y"][2]
    assert k["salt-empty"] == k["plain"] and k["salt-A"] == k["salt-A-again"] and k["salt-A"][0] != k["salt-B"][0]
    assert not set(k["lora-a1"]) & set(k["lora-a2"]) and not set(k["lora-a1"]) & set(k["plain"])
    ke = {n: ours(r) for n, r in embeds.items()}
    assert ke["embeds-1"][:3] == ke["embeds-2"][:3] and ke["embeds-1"][3] != ke["embeds-2"][3]
    assert compared > 300


def test_keys_do_not_follow_vllms_per_process_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    before_ours, before_vllm = ours(make(cache_salt="A")), make(cache_salt="A").block_hashes[0]
    monkeypatch.setenv("PYTHONHASHSEED", "1234")  # another deployment's environment
    init_none_hash(sha256)
    assert make(cache_salt="A").block_hashes[0] != before_vllm  # vLLM's hash moved...
    assert ours(make(cache_salt="A")) == before_ours  # ...ours did not
    monkeypatch.delenv("PYTHONHASHSEED")
    init_none_hash(xxhash)  # a non-cryptographic algorithm: a random seed per process
    first = kv_cache_utils.NONE_HASH
    init_none_hash(xxhash)
    assert first != kv_cache_utils.NONE_HASH
    assert ours(make(cache_salt="A")) == before_ours


# ---- the connector's scheduler side, with an embedded store's index fed by worker reports ----
def scheduler(model: str = "tiny", **extra: Any) -> HylinkerConnector:
    spec = {"block_size": BS, "num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}
    groups = [KVCacheGroupSpec(["model.layers.0.attn"], FullAttentionSpec(**spec)),
              KVCacheGroupSpec(["model.layers.1.linear_attn"],
                               MambaSpec(block_size=BS, shapes=((4, 64),), dtypes=(torch.float32,)))]
    ktc = KVTransferConfig(kv_connector="HylinkerConnector", kv_connector_module_path="hylinker.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"store": "embedded", **extra})
    config = VllmConfig(cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc)
    # the scheduler side reads the model's name and dtype only; a model config needs a checkpoint
    object.__setattr__(config, "model_config", SimpleNamespace(model=model, dtype=torch.bfloat16))
    return HylinkerConnector(config, KVConnectorRole.SCHEDULER,
                             KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups))


def hit(c: HylinkerConnector, request: Request) -> int:
    n, _ = c.get_num_new_matched_tokens(request, 0)
    return int(n or 0)


def compute_and_save(c: HylinkerConnector, request: Request) -> list[str]:
    """One prefill step of ``request``: the saves the connector plans (blocks and the states at
    every boundary), reported stored by the worker. Returns the object names."""
    rid = request.request_id
    assert hit(c, request) == 0
    ids = list(range(1, N_TOKENS // BS + 1))
    state = SimpleNamespace(get_block_ids=lambda r: [ids, ids] if r == rid else None,
                            boundary_state_offloads={rid: [(1, b, b * BS) for b in ids]})
    meta = c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={rid: N_TOKENS}, total_num_scheduled_tokens=N_TOKENS,
                                                  kv_connector_block_state=state))
    assert isinstance(meta, HylinkerConnectorMetadata)
    names = [n for plan in meta.saves for n in plan.kv_keys + plan.state_keys]
    c.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=HylinkerWorkerMetadata((RankReport(0, "w0", tuple(names)),))))
    c.request_finished_all_groups(request, ([], []))
    return names


def test_scheduler_side_serves_the_same_image_and_not_another(adapters: dict[str, Path]) -> None:
    c = scheduler()
    saved = compute_and_save(c, make(mm_features=image("x")))
    assert len(saved) == 2 * 8  # 8 blocks and 8 states
    assert hit(c, make(mm_features=image("x"))) == 8 * BS  # positive control: the same image
    assert hit(c, make(mm_features=image("y"))) == 2 * BS  # the blocks before the image only
    assert hit(c, make(mm_features=image("x", PlaceholderRange(IMAGE.offset + 1, IMAGE.length)))) == 2 * BS
    assert hit(c, make()) == 2 * BS  # no image: the placeholder tokens alone do not match
    compute_and_save(c, make(lora_request=LoRARequest("a1", 1, str(adapters["a1"]))))
    assert hit(c, make(lora_request=LoRARequest("a1", 7, str(adapters["a1"])))) == 8 * BS  # the int id is local
    assert hit(c, make(lora_request=LoRARequest("a2", 2, str(adapters["a2"])))) == 0
    compute_and_save(c, make(cache_salt="A"))
    assert hit(c, make(cache_salt="A")) == 8 * BS
    assert hit(c, make(cache_salt="B")) == 0
    assert c.statistics().requests_unkeyable == 0


def test_an_adapter_retrained_in_place_does_not_meet_its_old_blocks(adapters: dict[str, Path]) -> None:
    c = scheduler()
    a1 = adapters["a1"]
    compute_and_save(c, make(lora_request=LoRARequest("a1", 1, str(a1))))
    (a1 / "adapter_model.safetensors").write_bytes(b"\x09" * 64)  # new weights, same name and path
    vllm_request_keys._ADAPTER_DIGESTS.clear()  # as a restarted engine (the store outlives it)
    assert hit(c, make(lora_request=LoRARequest("a1", 1, str(a1)))) == 0


def test_adapter_digests_stay_bounded_for_a_server_loading_adapters_for_weeks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_request_keys, "ADAPTER_DIGESTS", 3)
    vllm_request_keys._ADAPTER_DIGESTS.clear()
    paths = []
    for i in range(5):
        (tmp_path / f"a{i}").mkdir()
        (tmp_path / f"a{i}" / "adapter_model.safetensors").write_bytes(bytes([i]) * 64)
        paths.append(str(tmp_path / f"a{i}"))
    first = vllm_request_keys.adapter_digest("a0", paths[0])
    for i in range(1, 5):
        vllm_request_keys.adapter_digest(f"a{i}", paths[i])
    assert list(vllm_request_keys._ADAPTER_DIGESTS) == [("a2", paths[2]), ("a3", paths[3]), ("a4", paths[4])]
    assert vllm_request_keys.adapter_digest("a0", paths[0]) == first  # forgotten, computed again: the same
    vllm_request_keys.adapter_digest("a3", paths[3])  # a use keeps it: the oldest unused goes first
    vllm_request_keys.adapter_digest("a1", paths[1])
    assert list(vllm_request_keys._ADAPTER_DIGESTS) == [("a0", paths[0]), ("a3", paths[3]), ("a1", paths[1])]
    vllm_request_keys._ADAPTER_DIGESTS.clear()


def test_the_checkpoint_revision_and_integrity_level_are_in_the_keys(tmp_path: Path) -> None:
    """Same files: the same seed in another connector; a changed config or weight file, another
    ``model_revision`` or integrity level: another seed (a store written before misses)."""
    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "model.safetensors").write_bytes(b"\x01" * 9000)
    base = scheduler(str(root))
    assert base.seed != scheduler("tiny").seed
    saved = compute_and_save(base, make())
    assert hit(base, make()) == 8 * BS
    assert scheduler(str(root)).seed == base.seed
    (root / "model.safetensors").write_bytes(b"\x01" * 9001)  # updated in place
    assert scheduler(str(root)).seed != base.seed
    (root / "model.safetensors").write_bytes(b"\x01" * 9000)
    (root / "config.json").write_text('{"hidden_size": 64, "tie_word_embeddings": true}')
    assert scheduler(str(root)).seed != base.seed
    (root / "config.json").write_text('{"hidden_size": 64}')
    assert scheduler(str(root)).seed == base.seed
    for other in (scheduler(str(root), integrity="header"), scheduler(str(root), model_revision="v2")):
        assert other.seed != base.seed
        assert not set(saved) & set(compute_and_save(other, make()))


@pytest.mark.parametrize("case", ["unknown-extra-key-kind", "salt-not-a-string", "adapter-not-a-directory",
                                  "malformed-image"])
def test_a_request_its_keys_cannot_describe_is_served_without_the_store(
        case: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    c = scheduler()
    compute_and_save(c, make())  # what a wrong key would hit: the plain prompt's objects
    assert hit(c, make()) == 8 * BS  # positive control
    if case == "unknown-extra-key-kind":
        real = vllm_request_keys.generate_block_hash_extra_keys

        def newer_vllm(request: Request, start: int, end: int, mm: int) -> tuple[Any, int]:
            keys, nxt = real(request, start, end, mm)
            return (keys or ()) + (("adapter_v2", "x"),), nxt

        monkeypatch.setattr(vllm_request_keys, "generate_block_hash_extra_keys", newer_vllm)
        request = make()  # a plain request too: the same tokens as the stored prompt
    elif case == "salt-not-a-string":
        request = make(cache_salt=5)
    elif case == "adapter-not-a-directory":
        request = make(lora_request=LoRARequest("a1", 1, str(tmp_path / "missing")))
    else:
        request = make(mm_features=[MultiModalFeatureSpec(None, "image", None, IMAGE)],
                       hashed=False)  # vLLM's own hasher asserts on it
    rid = request.request_id
    assert hit(c, request) == 0
    ids = list(range(1, 9))
    state = SimpleNamespace(get_block_ids=lambda r: [ids, ids], boundary_state_offloads={rid: [(1, 8, 8 * BS)]})
    meta = c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={rid: N_TOKENS}, total_num_scheduled_tokens=N_TOKENS,
                                                  kv_connector_block_state=state))
    assert isinstance(meta, HylinkerConnectorMetadata) and not meta.saves and not meta.loads  # nothing stored
    assert c.statistics().requests_unkeyable == 1
    report = c.get_kv_connector_stats()
    assert isinstance(report, HylinkerStats) and report.data["counter"]["lookups|unkeyable"] == 1
    c.request_finished_all_groups(request, ([], []))
    monkeypatch.undo()
    assert hit(c, make()) == 8 * BS  # other requests still use the store
