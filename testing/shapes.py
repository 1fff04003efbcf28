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


__all__ = ["QWEN3_NEXT_80B", "HybridGeometry", "gdn_state_shapes"]
