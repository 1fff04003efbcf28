"""Which rank writes a pool, and the rank term in its object keys: the one rule every front
(the ``Linker``'s :class:`~hylinker.components.layout.ModelLayout`, the SGLang plugin's
``integrations/sglang/placement.py``, the vLLM connector's ``integrations/vllm/index.py``) asks.

Of the ranks that hold the same bytes of a pool only the first writes them; the others report
success and read the writer's copy. How the holders of one copy lie over the ranks is the
engine's:

* ``replicas`` consecutive ranks hold one copy (vLLM replicating KV heads over ranks
  ``r // replicas``): rank ``r`` writes when ``r % replicas == 0``;
* the copies repeat every ``copies`` ranks (a replicated pool under decode-context
  parallelism, where each DCP group of consecutive TP ranks holds every DCP rank's tokens once;
  ``copies=1``: one copy, held by every rank): rank ``r`` writes when ``r < copies``.

A sharded pool (every rank its own bytes) is ``replicas=1``: every rank writes.

The rank term names which ranks share an object: ``tp<r>`` for a sharded pool, ``rep`` for a
replicated one, then ``dcp<d>`` for a DCP-folded pool (each DCP rank holds other tokens).
"""

from __future__ import annotations


def writes(rank: int, *, replicas: int = 1, copies: int | None = None) -> bool:
    """Whether ``rank`` writes a pool whose identical copies lie as the module docstring says:
    ``copies`` given, the copies repeat every ``copies`` ranks; else ``replicas`` consecutive
    ranks share one copy."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if copies is not None:
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        return rank < copies
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return rank % replicas == 0


def replicated_writes(tp_rank: int, *, replicated: bool, dcp_size: int = 1, folded: bool = False) -> bool:
    """The writer rule of a pool that is either sharded over the TP ranks or replicated on all
    of them: a sharded pool every rank; a replicated one TP rank 0, or, DCP-folded, the first
    DCP group (one writer per DCP rank)."""
    if not replicated:
        return True
    return writes(tp_rank, copies=dcp_size if folded and dcp_size > 1 else 1)


def rank_term(tp_rank: int, *, replicated: bool, dcp_rank: int | None = None) -> str:
    """``tp<r>`` or ``rep``, then ``dcp<d>`` where ``dcp_rank`` is given (a DCP-folded pool)."""
    term = "rep" if replicated else f"tp{tp_rank}"
    return term if dcp_rank is None else f"{term}dcp{dcp_rank}"


__all__ = ["rank_term", "replicated_writes", "writes"]
