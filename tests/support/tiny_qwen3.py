"""A tiny random-weight dense Qwen3 (attention only) and random PEFT LoRA adapters for it.

vLLM's CPU build runs LoRA on a dense attention model (its MoE models pick Triton's LoRA
kernels, which the CPU build cannot run), so the connector's LoRA test uses this model. The
adapters are written by hand in PEFT's format (``adapter_config.json`` plus
``adapter_model.safetensors``) on the attention projections, with random non-zero ``B``
matrices, so that an adapter changes the output. No hub access; built in seconds.

    model = build_tiny_qwen3(tmp_path / "model")
    adapter = write_random_lora(tmp_path / "a1", seed=1)
"""

from __future__ import annotations

import json
from pathlib import Path

#: tokens per vLLM block for this model (a multiple of vLLM CPU's attention block).
BLOCK_SIZE = 128
LAYERS = 2
HIDDEN = 128
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64
#: the projections the adapters touch: (name, in features, out features)
LORA_TARGETS = (("q_proj", HIDDEN, HEADS * HEAD_DIM), ("k_proj", HIDDEN, KV_HEADS * HEAD_DIM),
                ("v_proj", HIDDEN, KV_HEADS * HEAD_DIM), ("o_proj", HEADS * HEAD_DIM, HIDDEN))
LORA_RANK = 8


def build_tiny_qwen3(path: Path | str, *, seed: int = 0) -> Path:
    """Write a random-weight bf16 ``Qwen3ForCausalLM`` (:data:`LAYERS` full-attention layers) and
    the tiny tokenizer to ``path``; returns ``path``."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from hylinker.tools.harness.tiny_qwen3_next import VOCAB, build_tokenizer, save_random_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(path))
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=32768, initializer_range=0.1, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    return save_random_model(Qwen3ForCausalLM, config, path, seed)


def write_random_lora(path: Path | str, *, seed: int, scale: float = 0.5) -> Path:
    """Write a PEFT LoRA adapter for :func:`build_tiny_qwen3`'s model to ``path``: rank
    :data:`LORA_RANK` on every layer's :data:`LORA_TARGETS`, ``A`` and ``B`` drawn at random
    (``scale``) so the adapter changes the model's output; returns ``path``."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for name, fan_in, fan_out in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(LORA_RANK, fan_in, generator=gen) * scale).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, LORA_RANK, generator=gen) * scale).to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_RANK,
              "lora_dropout": 0.0, "bias": "none", "target_modules": [n for n, _, _ in LORA_TARGETS],
              "base_model_name_or_path": None, "fan_in_fan_out": False, "modules_to_save": None}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return path


__all__ = ["BLOCK_SIZE", "LORA_RANK", "LORA_TARGETS", "build_tiny_qwen3", "write_random_lora"]
