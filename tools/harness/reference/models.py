"""Tiny random-weight hybrid models from Hugging Face transformers, built locally and seeded.

No weights are downloaded: :func:`tiny_config` shrinks a model type's config (a few layers,
hidden 128, vocab 512, a few heads) and :func:`build_model` instantiates it with seeded
random weights, in eval mode, float32 on CPU by default.

Why float32: the oracle compares logprobs bit for bit, and on CPU float32 is both the fastest
path and the most sensitive one (a skipped or stale state shows up in every logit). bf16
is also bit-exact under the same chunk schedule, it is just slower on CPU; pass
``dtype=torch.bfloat16`` to try it. Linear-attention recurrent states stay float32 either way
(the models cast them).

Every model type transformers ships with a recurrent-state cache layer is listed by
:func:`recurrent_model_types` and gets a tiny config here (per-family sizes where a config's
validators constrain them). Tested in the fast suite: ``kimi_linear`` (MLA + KDA) and
``qwen3_next`` (GQA + Gated DeltaNet); every listed type runs through ``hylinker demo`` in
``tests/tools/test_hybrid_families.py``. A type hylinker cannot carry is refused with
:class:`UnsupportedModelError` and the reason (:func:`check_config`, and the engine's
``cache_geometry``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "DEFAULT_ARCH",
    "RECURRENT_LAYER_KINDS",
    "SUPPORTED_ARCHS",
    "UnsupportedModelError",
    "build_draft_model",
    "build_model",
    "check_config",
    "draft_config",
    "recurrent_model_types",
    "tiny_config",
]

DEFAULT_ARCH = "kimi_linear"
# model types the project tests; others are tried best effort
SUPPORTED_ARCHS = ("kimi_linear", "qwen3_next")

_TINY_VOCAB = 512
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# 3 linear-attention layers then 1 full-attention layer, as in Kimi Linear's 3:1 pattern
_HYBRID_4 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

#: the sizes Qwen3-Next's tiny config shares with the generic shrink: a small MoE transformer
_TINY_MOE: dict[str, Any] = {
    "vocab_size": _TINY_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
#: and its Gated DeltaNet mixer
_TINY_GDN: dict[str, Any] = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
}
_TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "kimi_linear": {
        "vocab_size": _TINY_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "n_shared_experts": 1,
        "linear_num_heads": 2,
        "linear_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "layer_types": _HYBRID_4,
        "max_position_embeddings": 4096,
        **_TOKEN_IDS,
    },
    "qwen3_next": {
        **_TINY_MOE,
        **_TINY_GDN,
        "layer_types": _HYBRID_4,
        "max_position_embeddings": 4096,
        **_TOKEN_IDS,
    },
}

# Tiny sizes for the other hybrid families, chosen so that each config's own validators pass
# (head counts x head sizes = the mixer's width, one expert per token where that is all the model
# supports, ...). Fields given here replace the generic shrink below.
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "bailing_hybrid": {  # MLA + KDA, like Kimi Linear
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "num_key_value_heads": 4, "linear_num_heads": 2, "linear_head_dim": 32,
        "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "num_expert_group": 1, "topk_group": 1, "layer_group_size": 4, "layer_types": _HYBRID_4,
    },
    "falcon_h1": {  # attention and Mamba2 side by side in every layer
        "mamba_expand": 1, "mamba_d_ssm": None, "mamba_n_heads": 4, "mamba_d_head": 32,
    },
    "mamba2": {"num_heads": 4, "head_dim": 32, "expand": 1, "n_groups": 1, "state_size": 16,
               "chunk_size": 64},
    "zamba": {"num_hidden_layers": 6, "attn_layer_period": 3, "attn_layer_offset": 2,
              "attention_head_dim": 32, "n_mamba_heads": 2},
    "zamba2": {"num_hidden_layers": 6, "attention_head_dim": 32,
               "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"]},
    "zaya": {"num_experts_per_tok": 1, "num_key_value_heads": 2},
    # Nemotron-H's default mixer is 128 heads x 64 wide with a 128-dim state in 8 groups, for a
    # hidden size of 128: the tiny model gets the other Mamba2 families' mixer
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1,
                   "chunk_size": 64},
    # Gated DeltaNet + QSA indexed attention; the default config leaves the indexer unset (the
    # model cannot be built so). A budget of 16 tokens in blocks of 4: sparse at every prompt
    # the tests use, so the indexer keys decide what attention sees
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 32,
                       "indexer_budget": 16, "indexer_compress_ratio": 4, "hc_lowrank": 16},
}

# Best-effort shrink for other model types: only fields the config already has are set.
_GENERIC_OVERRIDES: dict[str, Any] = {
    **_TINY_MOE,
    "unpadded_vocab_size": _TINY_VOCAB,  # Inkling 2's LM head (its default is 200058)
    "num_local_experts": 4,
    "max_position_embeddings": 4096,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_chunk_size": 64,
    **_TINY_GDN,
    # weights drawn 10x wider than the library's 0.02: at 0.02 the recurrent state of several
    # tiny families (the Mamba2 ones, Inkling's conv states, ...) moves the logprobs by ~1e-6,
    # so a negative control could not show that a wrong state is caught (tools/demo_controls.py)
    "initializer_range": 0.2,
    **_TOKEN_IDS,
}


# Best-effort layer patterns (3 recurrent layers then 1 attention layer) for other model types
_LAYER_PATTERN: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [3]},
    "jamba": {"attn_layer_period": 4, "attn_layer_offset": 3},
    "granitemoehybrid": {"layer_types": ["mamba", "mamba", "mamba", "attention"]},
    "bailing_hybrid": {"layer_types": _HYBRID_4},
    "olmo_hybrid": {"layer_types": _HYBRID_4},
    "qwen3_5_text": {"layer_types": _HYBRID_4},
    # LFM2's config defaults to attention on every layer (``full_attn_idxs`` = all), so its
    # default config has no conv layer; the released checkpoints are mostly short-conv layers
    "lfm2": {"layer_types": ["conv", "conv", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "conv", "conv", "full_attention"]},
}


class UnsupportedModelError(ValueError):
    """A model type (or its cache) cannot be used as a hylinker reference model."""


# Cache layer kinds (transformers ``layer_types`` after its own normalization) that hold a
# per-sequence recurrent state: what makes a model hybrid for hylinker.
RECURRENT_LAYER_KINDS = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})


@functools.cache
def recurrent_model_types() -> tuple[str, ...]:
    """Every transformers model type whose decoder cache has a recurrent-state layer, sorted.

    Read from the installed library, not from a list: each registered config is built with
    its defaults and its decoder's cache layer kinds are derived the way ``DynamicCache``
    derives them. A type whose defaults declare no recurrent layer but whose released
    checkpoints do (LFM2: attention on every layer by default) counts when its config, built
    with the layer pattern :data:`_LAYER_PATTERN` gives it, has one. Multimodal wrappers count
    as their text model (``qwen3_5`` -> ``qwen3_5_text``), so each decoder appears once. Takes a few seconds (every config is
    instantiated once); the result is cached.
    """
    import warnings

    from transformers import CONFIG_MAPPING
    from transformers.cache_utils import get_layer_types_and_kwargs
    from transformers.utils import logging as hf_logging

    found: set[str] = set()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs of some models warn about their token ids
    try:
        for model_type in list(CONFIG_MAPPING.keys()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    text = CONFIG_MAPPING[model_type]().get_text_config(decoder=True)
                    kinds, _ = get_layer_types_and_kwargs(text)
                    if not RECURRENT_LAYER_KINDS & set(kinds) and str(text.model_type) in _LAYER_PATTERN:
                        pattern = dict(_LAYER_PATTERN[str(text.model_type)])
                        pattern.setdefault("num_hidden_layers", len(pattern.get("layer_types", ())))
                        text = type(text)(**pattern)
                        kinds, _ = get_layer_types_and_kwargs(text)
                except Exception:  # configs of vision/audio models have no decoder layers
                    continue
            if RECURRENT_LAYER_KINDS & set(kinds):
                found.add(str(text.model_type))
    finally:
        hf_logging.set_verbosity(verbosity)
    return tuple(sorted(found))


def _config_class(arch: str) -> Any:
    from transformers import CONFIG_MAPPING

    if not isinstance(arch, str) or not arch:
        raise UnsupportedModelError(f"arch must be a transformers model type string, got {arch!r}")
    try:
        return CONFIG_MAPPING[arch]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown transformers model type {arch!r}; tested: {', '.join(SUPPORTED_ARCHS)}") from None


def tiny_config(arch: str = DEFAULT_ARCH, **overrides: Any) -> Any:
    """A tiny config for transformers model type ``arch`` (4 layers, hidden 128, vocab 512).

    ``kimi_linear`` and ``qwen3_next`` get 3 linear-attention layers then 1 full-attention
    layer. ``overrides`` replace any field (e.g. ``num_hidden_layers=8, layer_types=[...]``).
    Raises :class:`UnsupportedModelError` for unknown model types or a config that rejects
    the sizes.
    """
    cls = _config_class(arch)
    if arch in _TINY_OVERRIDES:
        fields = dict(_TINY_OVERRIDES[arch])
    else:
        defaults = cls()
        fields = {k: v for k, v in _GENERIC_OVERRIDES.items() if hasattr(defaults, k)}
        fields.update(_LAYER_PATTERN.get(arch, {}))
        fields.update(_FAMILY_OVERRIDES.get(arch, {}))
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and "layer_types" in fields:
        n = int(overrides["num_hidden_layers"])
        fields["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    fields.update(overrides)
    try:
        return cls(**fields)
    except Exception as exc:  # config validators raise several exception types
        raise UnsupportedModelError(f"cannot build a tiny {arch!r} config: {exc}") from exc


def draft_config(vocab_size: int = _TINY_VOCAB, num_layers: int = 1, **overrides: Any) -> Any:
    """A tiny llama config for the speculative-decoding draft model (same vocab as the target).

    One layer by default, so the draft rides on the tiny hybrid's single full-attention layer
    (a hylinker layout pairs draft layer ``d`` with the ``d``-th full-attention layer).
    """
    from transformers import LlamaConfig

    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        **_TOKEN_IDS,
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def _instantiate(config: Any, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    # fork_rng keeps the caller's global RNG untouched; the seed alone decides the weights
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except Exception as exc:  # model constructors raise several exception types
            raise UnsupportedModelError(
                f"cannot build a tiny {config.model_type!r} causal LM: {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    return model


def _check_causal_lm(model_type: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{model_type}: transformers ships no causal-LM class for this model type "
            "(AutoModelForCausalLM cannot build it), so it cannot run a prefill here")


def check_config(config: Any) -> None:
    """Refuse, with the reason, a config whose cache hylinker cannot describe.

    Checked on the config, before any weights exist: the model type has a causal-LM class.
    What only a forward shows (what each cache layer holds, where states live, whether a
    model honours them) is checked by
    :func:`~hylinker.tools.harness.reference.engine.cache_geometry`.
    """
    _check_causal_lm(str(config.model_type))


def build_model(
    arch: str = DEFAULT_ARCH,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> torch.nn.Module:
    """A tiny seeded random-weight causal LM of model type ``arch``: eval mode, CPU, ``dtype``.

    The same ``(arch, seed, dtype, overrides)`` always gives the same weights. Raises
    :class:`UnsupportedModelError` (with the reason) for a model type hylinker cannot carry.
    """
    _config_class(arch)  # an unknown model type is named as such first
    _check_causal_lm(arch)  # before the tiny config: some such configs reject generic sizes
    config = tiny_config(arch, **overrides)
    check_config(config)
    return _instantiate(config, seed, dtype)


def build_draft_model(
    vocab_size: int = _TINY_VOCAB,
    seed: int = 1,
    *,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> torch.nn.Module:
    """A tiny seeded llama draft model with the target's vocabulary; eval mode, CPU."""
    return _instantiate(draft_config(vocab_size, num_layers, **overrides), seed, dtype)
