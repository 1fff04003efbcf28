"""Real checkpoints' cache geometry: the numbers every real-shape test and figure builds from.

A tiny model at a real geometry keeps the layer count and pattern, the KV heads and head dims
and the recurrent state shapes of a published checkpoint (so its pages and states have the real
size and segment count) and shrinks what only costs forward time: hidden size, intermediate
sizes, experts, vocabulary, and query heads down to the KV head count.

Sources (read with the project's search tool, 2026-12-03): Qwen3-Next-80B-A3B's ``config.json``
(``Qwen/Qwen3-Next-80B-A3B-Instruct``; the same numbers in Qwen3-Coder-Next's): 48 layers,
``full_attention_interval`` 4, 16 query / 2 KV heads of 256, linear attention 16 key heads and
32 value heads of 128, ``linear_conv_kernel_dim`` 4, hidden 2048, 512 experts.
"""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class HybridGeometry:
    """A qwen3_next-style checkpoint's cache geometry (Gated DeltaNet + full attention)."""

    name: str
    layers: int
    full_attention_interval: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i in range(self.layers) if (i + 1) % self.full_attention_interval == 0]

    def layer_types(self) -> list[str]:
        full = set(self.full_attention_layers)
        return ["full_attention" if i in full else "linear_attention" for i in range(self.layers)]

    def conv_dim(self, tp: int = 1) -> int:
        return (2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim) // tp

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """One attention layer's K and V of one token on one rank."""
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * dtype_bytes

    def state_bytes(self, tp: int = 1) -> int:
        """One linear layer's state on one rank: bf16 conv window + fp32 recurrent state."""
        conv, ssm = gdn_state_shapes(self, tp)
        return conv[0] * conv[1] * 2 + ssm[0] * ssm[1] * ssm[2] * 4

    def vllm_block_size(self, tp: int = 1, alignment: int = 32) -> int:
        """The attention block vLLM's hybrid alignment picks: the least multiple of
        ``alignment`` (vLLM CPU's kernel block multiple) whose page holds a state."""
        per_token = self.kv_bytes_per_token(tp)
        tokens = -(-self.state_bytes(tp) // per_token)
        return -(-tokens // alignment) * alignment


def gdn_state_shapes(g: HybridGeometry, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """vLLM's Gated DeltaNet state shapes per rank: conv ``(kernel - 1, conv_dim)``, recurrent
    ``(value_heads, key_dim, value_dim)``."""
    return (g.conv_kernel - 1, g.conv_dim(tp)), (g.linear_value_heads // tp, g.linear_key_dim, g.linear_value_dim)


QWEN3_NEXT_80B = HybridGeometry(
    name="Qwen3-Next-80B-A3B", layers=48, full_attention_interval=4, num_kv_heads=2, head_dim=256,
    linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128, conv_kernel=4)




def build_qwen3_next_at(path: Path | str, geometry: HybridGeometry = QWEN3_NEXT_80B, *, seed: int = 0,
                        hidden: int = 128) -> Path:
    """Write a random-weight bf16 qwen3_next at ``geometry`` (its layers, pattern, KV heads,
    head dims and linear-attention heads) with a ``hidden``-wide residual stream, 2 experts of 64,
    query heads = KV heads and the tiny tokenizer's vocabulary; returns ``path``."""
    import torch
    from transformers import AutoTokenizer, Qwen3NextConfig, Qwen3NextForCausalLM

    from .tiny_qwen3_next import VOCAB, build_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(path))
    g = geometry
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=g.layers,
        num_attention_heads=g.num_kv_heads, num_key_value_heads=g.num_kv_heads, head_dim=g.head_dim,
        linear_conv_kernel_dim=g.conv_kernel, linear_key_head_dim=g.linear_key_dim,
        linear_value_head_dim=g.linear_value_dim, linear_num_key_heads=g.linear_key_heads,
        linear_num_value_heads=g.linear_value_heads, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
        layer_types=g.layer_types(), max_position_embeddings=65536, initializer_range=0.1,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    model.config.architectures = ["Qwen3NextForCausalLM"]
    model.save_pretrained(str(path))
    return path


__all__ = ["QWEN3_NEXT_80B", "HybridGeometry", "build_qwen3_next_at", "gdn_state_shapes"]
