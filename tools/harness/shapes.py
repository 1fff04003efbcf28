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
from typing import Any

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
    from transformers import AutoTokenizer, Qwen3NextConfig

    from .tiny_qwen3_next import VOCAB, build_tokenizer, save_random_qwen3_next

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
    return save_random_qwen3_next(config, path, seed)


def sglang_cache_spec(geometry: HybridGeometry = QWEN3_NEXT_80B, *, page_size: int = 64, tree_core: str = "python",
                      kv_pages: int = 16, mamba_slots: int = 4) -> Any:
    """The SGLang harness's :class:`~hylinker.tools.harness.sglang_cache.CacheSpec` at ``geometry``:
    its layers and full-attention pattern, MHA KV heads and head dim, and the Mamba2 state shape
    SGLang derives for Qwen3-Next (``sglang/srt/configs/qwen3_next.py``: intermediate = value heads x value
    dim, ``n_groups`` = key heads, state size = key dim), fp32 recurrent state. Pages above 1
    use SGLang's ``extra_buffer`` Mamba strategy (it needs it there)."""
    from .sglang_cache import CacheSpec

    g = geometry
    return CacheSpec(
        page_size=page_size, kv="mha", model="hybrid", num_layers=g.layers,
        full_layers=tuple(g.full_attention_layers), head_num=g.num_kv_heads, head_dim=g.head_dim,
        mamba_heads=g.linear_value_heads, mamba_head_dim=g.linear_value_dim, mamba_state=g.linear_key_dim,
        mamba_intermediate=g.linear_value_heads * g.linear_value_dim, mamba_groups=g.linear_key_heads,
        mamba_conv_kernel=g.conv_kernel, mamba_ssm_dtype="float32", mamba_extra_buffer=page_size > 1,
        kv_pages=kv_pages, mamba_slots=mamba_slots, max_reqs=2, max_context=kv_pages * page_size,
        tree_core=tree_core)


#: Kimi-Linear-48B-A3B (``moonshotai/Kimi-Linear-48B-A3B-Instruct`` config.json, read with the
#: search tool): 27 layers, MLA at (1-based) layers 4, 8, ..., 24 and 27 (7 layers; KDA : MLA about
#: 3 : 1), MLA latent 512 + rope 64, KDA 32 heads of 128, short conv kernel 4.
KIMI_LINEAR_48B_FULL_LAYERS = (3, 7, 11, 15, 19, 23, 26)


def transformers_overrides(arch: str, *, hidden: int = 128) -> dict[str, Any]:
    """Config fields that put transformers' ``arch`` (``qwen3_next`` or ``kimi_linear``) at its
    real checkpoint's cache geometry, on top of the reference model's tiny config (which keeps
    the shrunk hidden size, experts and vocabulary). Query heads drop to the KV head count (MLA:
    2 heads, its cache is the latent either way)."""
    if arch == "qwen3_next":
        g = QWEN3_NEXT_80B
        return {"num_hidden_layers": g.layers, "layer_types": g.layer_types(), "hidden_size": hidden,
                "num_attention_heads": g.num_kv_heads, "num_key_value_heads": g.num_kv_heads,
                "head_dim": g.head_dim, "linear_num_key_heads": g.linear_key_heads,
                "linear_num_value_heads": g.linear_value_heads, "linear_key_head_dim": g.linear_key_dim,
                "linear_value_head_dim": g.linear_value_dim, "linear_conv_kernel_dim": g.conv_kernel}
    if arch == "kimi_linear":
        layers = 27
        return {"num_hidden_layers": layers, "hidden_size": hidden,
                "layer_types": ["full_attention" if i in KIMI_LINEAR_48B_FULL_LAYERS else "linear_attention"
                                for i in range(layers)],
                "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128, "v_head_dim": 128, "linear_num_heads": 32, "linear_head_dim": 128,
                "linear_conv_kernel_dim": 4}
    raise ValueError(f"no real geometry recorded for {arch!r} (qwen3_next, kimi_linear)")


def kimi_linear_sglang_cache_spec(*, page_size: int = 64, tree_core: str = "python", kv_pages: int = 8,
                                  mamba_slots: int = 4) -> Any:
    """The SGLang harness's ``CacheSpec`` at Kimi-Linear-48B's geometry: 27 layers, MLA (latent
    512 + rope 64) at :data:`KIMI_LINEAR_48B_FULL_LAYERS`, and KDA's state in SGLang's Mamba2
    shape: a conv window over q, k and v (3 x 32 heads x 128 = 12,288 channels, kernel 4) and a
    32 x 128 x 128 fp32 recurrent state per layer."""
    from .sglang_cache import CacheSpec

    return CacheSpec(
        page_size=page_size, kv="mla", model="hybrid", num_layers=27, full_layers=KIMI_LINEAR_48B_FULL_LAYERS,
        kv_lora_rank=512, qk_rope_head_dim=64, mamba_heads=32, mamba_head_dim=128, mamba_state=128,
        mamba_intermediate=32 * 128, mamba_groups=32, mamba_conv_kernel=4, mamba_ssm_dtype="float32",
        mamba_extra_buffer=page_size > 1, kv_pages=kv_pages, mamba_slots=mamba_slots, max_reqs=2,
        max_context=kv_pages * page_size, tree_core=tree_core)


def poll_loads(transfers: Any, timeout_s: float) -> tuple[set[str], set[str]]:
    """Poll a :class:`~hylinker.integrations.vllm.pages.PageTransfers` until a load ended (or
    ``timeout_s``): its ``finished_loads()`` (landed, failed)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        done, bad = transfers.finished_loads()
        if done or bad or time.monotonic() > deadline:
            return done, bad
        time.sleep(0.001)


__all__ = ["KIMI_LINEAR_48B_FULL_LAYERS", "QWEN3_NEXT_80B", "HybridGeometry", "build_qwen3_next_at", "gdn_state_shapes", "kimi_linear_sglang_cache_spec", "poll_loads", "sglang_cache_spec", "transformers_overrides"]
