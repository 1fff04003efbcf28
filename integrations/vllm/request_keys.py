"""What a vLLM request adds to its block keys beyond its tokens: vLLM's own block-hash extra keys.

vLLM 0.32 hashes every prefix-cache block with *extra keys* from the request
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``): the LoRA adapter's name
and path on every block, ``("mm", identifier, offset in the block)`` for every multimodal input
overlapping the block, the request's ``cache_salt`` on block 0, and a SHA-256 of the block's
prompt embeddings. The connector asks that same function for each of its blocks and folds the
answer into its own chained key (:func:`~hylinker.integrations.vllm.plan.fold_extra_keys`), so two
requests share a stored block exactly when vLLM's own cache would let them share it.

It does not use vLLM's block hashes themselves: their chain starts at ``NONE_HASH``, which is
random per process for the non-cryptographic ``xxhash`` algorithms unless ``PYTHONHASHSEED`` is
set, and otherwise comes from ``PYTHONHASHSEED`` or a fixed default — so it depends on each
process's environment and hash algorithm. The extra keys are plain values (names, paths, content
hashes of the inputs, digests) that every process computes alike; the connector encodes them
canonically (:func:`~hylinker.integrations.vllm.plan.encode_extra_keys`) and hashes them with its
own function.

On top of vLLM's key, a LoRA request's seed carries a digest of the adapter's files
(:func:`adapter_digest`): the store outlives the engine, so an adapter retrained in place (same
name, same path, new weights) must not meet the blocks of its old weights after a restart. An
adapter whose path is not a readable local directory, an extra-key kind or value the encoding does
not know, a ``cache_salt`` that is not a string: the request raises
:class:`~hylinker.integrations.vllm.plan.UnkeyableRequest` here, and the connector serves it
without the store (counted, logged), never under a key that could match another request's.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from ...components.identity import directory_digest
from .plan import BlockExtras, BlockKeys, UnkeyableRequest, encode_extra_keys, request_seed

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: bounded: the last ADAPTER_DIGESTS adapters' digests (a server that loads adapters for weeks
#: recomputes an evicted one's on its next request)
_ADAPTER_DIGESTS: collections.OrderedDict[tuple[str, str], bytes] = collections.OrderedDict()
ADAPTER_DIGESTS = 1024


def adapter_digest(name: str, path: str) -> bytes:
    """:func:`~hylinker.components.identity.directory_digest` of the adapter's files, computed once
    per (name, path) in a process. Raises :class:`UnkeyableRequest` where ``path`` is not a
    readable local directory."""
    known = _ADAPTER_DIGESTS.get((name, path))
    if known is not None:
        _ADAPTER_DIGESTS.move_to_end((name, path))
        return known
    try:
        digest = directory_digest(path)
    except NotADirectoryError:
        raise UnkeyableRequest(f"LoRA adapter {name!r}: path {path!r} is not a local directory") from None
    except OSError as exc:
        raise UnkeyableRequest(f"LoRA adapter {name!r}: cannot read {path!r}: {exc}") from exc
    _ADAPTER_DIGESTS[(name, path)] = digest
    while len(_ADAPTER_DIGESTS) > ADAPTER_DIGESTS:
        _ADAPTER_DIGESTS.popitem(last=False)
    return digest


def seed_parts(request: Request) -> list[tuple[object, ...]]:
    """The request-wide parts of its seed that vLLM's extra keys do not carry: the adapter's files."""
    salt = request.cache_salt
    if salt is not None and not isinstance(salt, str):
        raise UnkeyableRequest(f"cache_salt must be a string, got {type(salt).__name__}")
    lora = request.lora_request
    if lora is None:
        return []
    name, path = lora.lora_name, lora.lora_path
    if not isinstance(name, str) or not isinstance(path, str):
        raise UnkeyableRequest(f"LoRA adapter name {name!r} / path {path!r} are not strings")
    return [("lora", name, path, adapter_digest(name, path))]


def block_extras(request: Request, block_size: int) -> BlockExtras:
    """``extras(i)``: the encoded extra keys vLLM's block hash carries for block ``i`` of
    ``request`` (tokens ``[i · block_size, (i + 1) · block_size)``), None where it carries none.
    Blocks are asked in order (the multimodal cursor moves forward, as in vLLM)."""
    cursor = [0, 0]  # next block, multimodal index at it

    def extras(i: int) -> bytes | None:
        if i != cursor[0]:
            raise UnkeyableRequest(f"block {i} asked out of order (next is {cursor[0]})")
        try:
            keys, cursor[1] = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size,
                                                             cursor[1])
        except UnkeyableRequest:
            raise
        except Exception as exc:  # vLLM's function asserts on malformed inputs
            raise UnkeyableRequest(f"vLLM's extra keys of block {i} failed: {type(exc).__name__}: {exc}") from exc
        cursor[0] = i + 1
        if not keys:
            return None
        return encode_extra_keys(keys)

    return extras




def request_block_keys(seed: bytes, block_size: int, request: Request) -> BlockKeys:
    """The chained block keys of ``request`` under the deployment seed ``seed``; raises
    :class:`UnkeyableRequest` now or as the keys extend (see the module docstring). Every
    request asks vLLM's function, a plain one too, so a kind a later vLLM adds is never missed;
    a block without extra keys keeps the plain chained key."""
    return BlockKeys(request_seed(seed, seed_parts(request)), block_size, block_extras(request, block_size))


__all__ = ["adapter_digest", "block_extras", "request_block_keys", "seed_parts"]
