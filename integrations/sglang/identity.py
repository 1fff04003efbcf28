"""What SGLang's deployment adds to the plugin's key namespace (``components/identity.py``).

SGLang names its pages itself (``get_storage_hash_str``: the tokens, chained from
``extra_key`` — a LoRA request's ``lora_id`` appended — and ``cache_salt``) and hands the plugin
only those names: the plugin cannot tell which adapter a page was computed under. A start-up
adapter's ``lora_id`` is ``uuid5(name, path)`` (``--lora-paths``), the same after a restart
even if its files were retrained in place. So the plugin digests the files of every start-up
adapter (``server_args.lora_paths``) and folds them into its whole namespace: an adapter changed
in place changes every key of the deployment (a miss for all, never another adapter's state).
An adapter loaded at run time (``/load_lora_adapter``) gets a random ``lora_id`` from SGLang, so
its pages never match across processes: nothing stale to meet, nothing to digest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...components.identity import adapters_term, model_identity, namespace_term


def start_up_adapters(lora_paths: Any) -> list[tuple[str, str]]:
    """``(name, path)`` of each adapter SGLang loads at start-up, from ``server_args.lora_paths``
    in any of the forms SGLang takes: ``LoRARef``-like objects, ``{"lora_name", "lora_path"}``
    dicts, ``"name=path"`` or bare path strings, or a ``{name: path}`` dict."""
    if not lora_paths:
        return []
    items: Iterable[Any] = lora_paths.items() if isinstance(lora_paths, dict) else lora_paths
    out: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, tuple):
            name, path = item
        elif isinstance(item, str):
            name, sep, path = item.partition("=")
            name, path = (name, path) if sep else (item, item)
        elif isinstance(item, dict):
            name, path = item["lora_name"], item["lora_path"]
        else:
            name, path = getattr(item, "lora_name", None), getattr(item, "lora_path", None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f"HylinkerLinker: cannot read a LoRA adapter's name and path from {item!r}")
        out.append((name, path))
    return out


def deployment_term(server_args: Any, model_revision: str, integrity: str) -> bytes:
    """The namespace term of this SGLang deployment: the model's identity (its checkpoint
    ``model_path`` fingerprinted, ``model_revision``), the integrity level and the start-up
    adapters' digests."""
    model = str(getattr(server_args, "model_path", "") or "")
    adapters = adapters_term(start_up_adapters(getattr(server_args, "lora_paths", None)))
    return namespace_term(model_identity(model, model_revision), integrity, adapters)


__all__ = ["deployment_term", "start_up_adapters"]
