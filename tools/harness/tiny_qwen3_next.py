"""A tiny random-weight qwen3_next (Gated DeltaNet + full attention) saved to a local folder.

vLLM's CPU build runs this model type end to end (bf16; linear-attention head dims 64 or 128),
so the vLLM connector's tests and demo use it: no hub access, built in seconds. The tokenizer is
a small word-level BPE trained here with the ``tokenizers`` library, with a plain chat template so
the OpenAI server's chat endpoint works. Needs ``transformers`` and ``tokenizers``.

    path = build_tiny_qwen3_next(tmp_path / "model")
    LLM(model=str(path), dtype="bfloat16", block_size=BLOCK_SIZE, ...)

The weights are random (seeded), drawn wider than a trained model's so that greedy tokens and
logprobs depend visibly on the whole context: a wrong restored state changes the output.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

#: tokens per vLLM block for this model: pass it explicitly (``block_size=``), otherwise vLLM's
#: scheduler keeps a 16-token Mamba block while the worker raises the attention block.
BLOCK_SIZE = 384
VOCAB = 1024

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

_WORDS = ["the", "a", "an", "of", "to", "in", "on", "for", "with", "from", "by", "about", "cache", "state", "page", "block", "token", "model", "layer", "store", "load", "save", "restore", "recurrent", "attention", "linear", "hybrid", "prefix", "boundary", "checkpoint", "transfer", "commit", "engine", "server", "request", "reply", "user", "assistant", "system", "question", "answer", "river", "mountain", "forest", "ocean", "city", "garden", "winter", "summer", "morning", "evening", "story", "letter", "number", "seven", "eleven", "red", "blue", "green", "quick", "slow", "bright", "dark", "open", "close", "begin", "end"]


def corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(n_lines)]


def build_tokenizer(path: Path, *, seed: int = 0) -> None:
    """Train a small BPE tokenizer and save it (``save_pretrained``) into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|unk|>"]
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 64, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(2000, seed), trainer=trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|eos|>",
                                   unk_token="<|unk|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def build_tiny_qwen3_next(path: Path | str, *, seed: int = 0, layers: int = 4) -> Path:
    """Write a random-weight bf16 qwen3_next (``layers`` layers, every 4th full attention) and its
    tokenizer to ``path``; returns ``path``. Same seed, same bytes."""
    from transformers import Qwen3NextConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, seed=seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,  # both divide by TP 2
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, layer_types=layer_types,
        max_position_embeddings=32768, initializer_range=0.1, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    return save_random_qwen3_next(config, path, seed)


def save_random_qwen3_next(config: Any, path: Path, seed: int) -> Path:
    """Instantiate ``config`` with seeded random weights in bf16 and save it into ``path``."""
    from transformers import Qwen3NextForCausalLM

    return save_random_model(Qwen3NextForCausalLM, config, path, seed)


def save_random_model(model_class: Any, config: Any, path: Path, seed: int) -> Path:
    """Instantiate transformers' ``model_class`` from ``config`` with seeded random weights in
    bf16 and save it into ``path`` (its ``architectures`` set to the class's name)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    model.to(dtype=torch.bfloat16)
    model.config.architectures = [model_class.__name__]
    model.save_pretrained(str(path))
    return path


__all__ = ["BLOCK_SIZE", "CHAT_TEMPLATE", "VOCAB", "build_tiny_qwen3_next", "build_tokenizer", "save_random_model", "save_random_qwen3_next"]
