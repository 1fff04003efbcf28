"""ModelLayout: validation (every bad field is a LayoutError naming it), fingerprint, geometry."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hylinker.components.layout import LayoutError, MambaLayerSpec, ModelLayout, PoolKind
from hylinker.components.mamba import checkpoint_grid

MAMBA: list[dict[str, Any]] = [
    {"layer_id": 1, "conv_shape": (3, 8), "conv_dtype": "bfloat16",
     "temporal_shape": (2, 4, 4), "temporal_dtype": "float32"},
    {"layer_id": 3, "conv_shape": (3, 8), "conv_dtype": "bfloat16"},  # conv only
]


def base(**over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "page_size": 16,
        "chunk_size": 64,
        "full_layers": [0, 2],
        "kv_row_shape": (8,),
        "kv_dtype": torch.bfloat16,
        "mamba_layers": MAMBA,
        "draft_layers": 1,
        "draft_row_shape": (4,),
        "draft_dtype": "float16",
        "tp_rank": 0,
        "tp_size": 2,
        "model_name": "tiny",
    }
    kw.update(over)
    return kw


def make(**over: Any) -> ModelLayout:
    return ModelLayout.create(**base(**over))


def mamba_with(**fields: Any) -> list[dict[str, Any]]:
    return [{**MAMBA[0], **fields}]


# (case id, overrides, substring the message must contain: the field's name)
BAD_LAYOUTS: list[tuple[str, dict[str, Any], str]] = [
    ("page zero", {"page_size": 0}, "page_size"),
    ("page bool", {"page_size": True}, "page_size"),
    ("page float", {"page_size": 16.0}, "page_size"),
    ("chunk negative", {"chunk_size": -64}, "chunk_size"),
    ("page/chunk grid too coarse 100/64", {"page_size": 100}, "page_size=100 and chunk_size=64"),
    ("page/chunk grid too coarse 96/80", {"chunk_size": 80, "page_size": 96},
     "page_size=96 and chunk_size=80"),
    ("full and mamba layers empty", {"full_layers": [], "mamba_layers": []}, "full_layers"),
    ("kv rows without full layers", {"full_layers": [], "draft_layers": 0}, "kv_row_shape"),
    ("draft without full layers", {"full_layers": [], "kv_row_shape": None}, "draft_layers"),
    ("full layers repeated", {"full_layers": [0, 0]}, "full_layers"),
    ("full layers negative", {"full_layers": [-1, 0]}, "full_layers"),
    ("full layers bool", {"full_layers": [True]}, "full_layers"),
    ("kv dtype str", {"kv_dtype": "float64"}, "kv_dtype"),
    ("kv dtype torch", {"kv_dtype": torch.float64}, "kv_dtype"),
    ("kv dtype int64", {"kv_dtype": torch.int64}, "kv_dtype"),
    ("draft dtype", {"draft_dtype": torch.int32}, "draft_dtype"),
    ("conv dtype", {"mamba_layers": mamba_with(conv_dtype=torch.int64)}, "mamba_layers[0].conv_dtype"),
    ("temporal dtype", {"mamba_layers": mamba_with(temporal_dtype=torch.complex64)},
     "mamba_layers[0].temporal_dtype"),
    ("temporal shape without dtype", {"mamba_layers": mamba_with(temporal_dtype=None)}, "mamba_layers[0]"),
    ("kv shape empty", {"kv_row_shape": ()}, "kv_row_shape"),
    ("kv shape zero", {"kv_row_shape": (8, 0)}, "kv_row_shape"),
    ("kv shape negative", {"kv_row_shape": (-8,)}, "kv_row_shape"),
    ("kv shape float", {"kv_row_shape": (8.0,)}, "kv_row_shape"),
    ("draft shape zero", {"draft_row_shape": (0,)}, "draft_row_shape"),
    ("draft shape missing", {"draft_row_shape": None}, "draft_row_shape"),
    ("conv shape empty", {"mamba_layers": mamba_with(conv_shape=())}, "mamba_layers[0].conv_shape"),
    ("conv shape not iterable", {"mamba_layers": mamba_with(conv_shape=5)}, "mamba_layers[0]"),
    ("temporal shape zero", {"mamba_layers": mamba_with(temporal_shape=(2, 0))},
     "mamba_layers[0].temporal_shape"),
    ("mamba unknown field", {"mamba_layers": mamba_with(bogus=1)}, "mamba_layers[0]"),
    ("mamba not a spec", {"mamba_layers": [3]}, "mamba_layers[0]"),
    ("mamba layer id negative", {"mamba_layers": mamba_with(layer_id=-1)}, "mamba_layers[0].layer_id"),
    ("mamba ids repeated", {"mamba_layers": [MAMBA[0], MAMBA[0]]}, "mamba_layers"),
    ("tp rank too big", {"tp_rank": 2}, "tp_rank"),
    ("tp rank negative", {"tp_rank": -1}, "tp_rank"),
    ("tp rank str", {"tp_rank": "0"}, "tp_rank"),
    ("tp rank float", {"tp_rank": 1.0}, "tp_rank"),
    ("tp size zero", {"tp_size": 0}, "tp_size"),
    ("dcp rank too big", {"dcp_rank": 2, "dcp_size": 2}, "dcp_rank"),
    ("dcp rank negative", {"dcp_rank": -1}, "dcp_rank"),
    ("dcp size zero", {"dcp_size": 0}, "dcp_size"),
    ("replicated unknown", {"replicated": ["kv", "bogus"]}, "replicated"),
    ("replicated int", {"replicated": [3]}, "replicated"),
    ("draft > full", {"draft_layers": 3}, "draft_layers"),
    ("draft negative", {"draft_layers": -1}, "draft_layers"),
    ("draft str", {"draft_layers": "1"}, "draft_layers"),
]


@pytest.mark.parametrize(("over", "field"), [(o, f) for _, o, f in BAD_LAYOUTS],
                         ids=[c for c, _, _ in BAD_LAYOUTS])
def test_bad_layout_names_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(LayoutError) as info:
        make(**over)
    assert field in str(info.value)


@pytest.mark.parametrize(("page", "chunk"), [(16, 64), (64, 64), (256, 64), (32, 96), (64, 16),
                                             (96, 64), (48, 64), (16, 24)])
def test_compatible_page_chunk_pairs_build(page: int, chunk: int) -> None:
    layout = make(page_size=page, chunk_size=chunk)
    assert layout.grid == checkpoint_grid(chunk, page)
    assert layout.grid % page == 0 and layout.grid % chunk == 0


def test_a_layer_may_carry_both_kv_and_a_state() -> None:
    # Falcon-H1 / Zamba layers run attention and a Mamba mixer side by side
    layout = make(mamba_layers=mamba_with(layer_id=0))
    assert 0 in layout.full_layers and [s.layer_id for s in layout.mamba_layers] == [0]
    assert layout.fingerprint != make().fingerprint


def test_incompatible_page_chunk_is_fine_without_mamba() -> None:
    # Only checkpoints need page/chunk alignment: a pure-attention layout ignores the chunk.
    layout = make(page_size=48, mamba_layers=[])
    assert not layout.is_hybrid and layout.grid == 48


def test_layout_is_an_error_of_kind_value_error() -> None:
    assert issubclass(LayoutError, ValueError)


# ---- fingerprint ---------------------------------------------------------------------
def test_fingerprint_same_inputs_same_bytes() -> None:
    a, b = make(), make()
    assert a is not b
    assert a.fingerprint == b.fingerprint
    assert isinstance(a.fingerprint, bytes) and len(a.fingerprint) == 32


def test_fingerprint_accepts_equivalent_spellings() -> None:
    specs = [MambaLayerSpec(1, (3, 8), torch.bfloat16, (2, 4, 4), torch.float32),
             MambaLayerSpec(3, (3, 8), torch.bfloat16)]
    a = make()
    b = make(kv_dtype="bfloat16", draft_dtype=torch.float16, mamba_layers=specs,
             full_layers=(0, 2), kv_row_shape=[8])
    assert a.fingerprint == b.fingerprint


def test_fingerprint_golden() -> None:
    # Every stored object is keyed through this value: changing it orphans every store.
    # If describe() changes on purpose, update the constant (and say so in the changelog).
    layout = ModelLayout.create(page_size=16, full_layers=[0], kv_row_shape=(4,), kv_dtype="float32")
    assert layout.fingerprint.hex() == GOLDEN


GOLDEN = "5ddb99c22f75909c4e08e3066eb345af78b433f6293b036ae19908891c137fe6"


@pytest.mark.parametrize("rank_over", [{"tp_rank": 1}, {"tp_rank": 1, "dcp_rank": 1, "dcp_size": 2}],
                         ids=["tp_rank", "dcp_rank"])
def test_fingerprint_excludes_rank(rank_over: dict[str, Any]) -> None:
    size_over = {k: v for k, v in rank_over.items() if k.endswith("size")}
    assert make(**rank_over).fingerprint == make(**size_over).fingerprint


FINGERPRINT_CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("page", {"page_size": 64}),
    ("chunk", {"chunk_size": 128}),
    ("full layers", {"full_layers": [0, 2, 4]}),
    ("full layer ids", {"full_layers": [0, 4]}),
    ("kv shape", {"kv_row_shape": (16,)}),
    ("kv shape split", {"kv_row_shape": (2, 4)}),
    ("kv dtype", {"kv_dtype": torch.float16}),
    ("conv shape", {"mamba_layers": [{**MAMBA[0], "conv_shape": (4, 8)}, MAMBA[1]]}),
    ("conv dtype", {"mamba_layers": [{**MAMBA[0], "conv_dtype": "float32"}, MAMBA[1]]}),
    ("temporal shape", {"mamba_layers": [{**MAMBA[0], "temporal_shape": (2, 4, 8)}, MAMBA[1]]}),
    ("temporal dtype", {"mamba_layers": [{**MAMBA[0], "temporal_dtype": "bfloat16"}, MAMBA[1]]}),
    ("mamba layer id", {"mamba_layers": [MAMBA[0], {**MAMBA[1], "layer_id": 5}]}),
    ("mamba layer dropped", {"mamba_layers": [MAMBA[0]]}),
    ("draft layers", {"draft_layers": 2}),
    ("draft shape", {"draft_row_shape": (8,)}),
    ("draft dtype", {"draft_dtype": "bfloat16"}),
    ("tp size", {"tp_size": 4}),
    ("dcp size", {"dcp_size": 2}),
    ("replicated", {"replicated": ["mamba"]}),
    ("model name", {"model_name": "other"}),
]


@pytest.mark.parametrize("over", [o for _, o in FINGERPRINT_CHANGES],
                         ids=[c for c, _ in FINGERPRINT_CHANGES])
def test_fingerprint_changes_with_every_byte_deciding_field(over: dict[str, Any]) -> None:
    assert make(**over).fingerprint != make().fingerprint


def test_fingerprints_of_all_changes_are_distinct() -> None:
    prints = {make(**o).fingerprint for _, o in FINGERPRINT_CHANGES} | {make().fingerprint}
    assert len(prints) == len(FINGERPRINT_CHANGES) + 1


# ---- derived geometry ----------------------------------------------------------------
def test_geometry() -> None:
    layout = make()
    assert layout.is_hybrid
    assert layout.grid == 64
    assert layout.pools == (PoolKind.FULL, PoolKind.MAMBA, PoolKind.DRAFT)
    assert layout.kv_row_bytes == 2 * 8 * 2  # 2 layers x 8 bf16
    assert layout.draft_row_bytes == 1 * 4 * 2  # 1 layer x 4 fp16
    assert layout.mamba_state_bytes == (3 * 8 * 2 + 2 * 4 * 4 * 4) + 3 * 8 * 2
    assert layout.payload_bytes(PoolKind.FULL) == 16 * layout.kv_row_bytes
    assert layout.payload_bytes(PoolKind.DRAFT) == 16 * layout.draft_row_bytes
    assert layout.payload_bytes(PoolKind.MAMBA) == layout.mamba_state_bytes


def test_pure_attention_geometry() -> None:
    layout = make(mamba_layers=[], draft_layers=0, page_size=32)
    assert layout.pools == (PoolKind.FULL,)
    assert layout.grid == 32
    assert layout.draft_row_bytes == 0
    assert layout.draft_row_shape is None and layout.draft_dtype is None


@pytest.mark.parametrize(("rank", "replicated", "pool", "writes", "term"), [
    (0, [], PoolKind.FULL, True, "tp0"),
    (1, [], PoolKind.FULL, True, "tp1"),
    (1, [], PoolKind.MAMBA, True, "tp1"),
    (0, ["mamba"], PoolKind.MAMBA, True, "rep"),
    (1, ["mamba"], PoolKind.MAMBA, False, "rep"),
    (1, ["mamba"], PoolKind.FULL, True, "tp1"),
    (1, [PoolKind.DRAFT], PoolKind.DRAFT, False, "rep"),
])
def test_writes_and_rank_term(rank: int, replicated: list[Any], pool: PoolKind, writes: bool,
                              term: str) -> None:
    layout = make(tp_rank=rank, replicated=replicated)
    assert layout.writes(pool) is writes
    assert layout.rank_term(pool) == term


def test_describe_excludes_ranks() -> None:
    d = make(tp_rank=1, dcp_rank=1, dcp_size=2).describe()
    assert "tp_rank" not in d and "dcp_rank" not in d
    assert d["tp_size"] == 2 and d["dcp_size"] == 2
