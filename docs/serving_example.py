"""Embedding hylinker in an asyncio serving frontend, on the tiny reference hybrid model.

Run it::

    python docs/serving_example.py [--sessions 3] [--turns 2] [--arch kimi_linear]

Several chat sessions run concurrently. Every request goes through the runtime's phases::

    lookup  -> load -> commit            the cached prefix: device tree, else the store
    forward                              prefill the rest (64-token chunks on the absolute
                                         grid), then decode a few tokens
    insert                               donate KV rows + the state at the checkpoint depth;
                                         write-through offload to the store
    release                              unlock, free what the request still owns

Replica A serves the first ``--turns`` turns of every session. Then replica B — fresh device
pools, an empty device tree, the same store (as another instance behind a shared Mooncake, or
A after a restart) — serves one more turn of every session: those prefixes can only come
from the store. At the end every request's logprobs and generated tokens are checked against
a run that never used the cache: they must be identical, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.base import Store
from hylinker.stores.embedded import EmbeddedStore
from hylinker.tools.harness.reference import (
    ReferenceEngine,
    build_draft_model,
    build_model,
    read_boundary,
    write_boundary,
)
from hylinker.tools.harness.reference.runtime_engine import pool_views

PAGE_SIZE = 16
CHUNK_TOKENS = 64  # the linear-attention chunk; every checkpoint is a chunk end
T = TypeVar("T")


@dataclass
class Completion:
    """One served request: what it computed, and what hylinker gave it."""

    request_id: str
    prompt: list[int]
    device_tokens: int  # prefix found in this replica's device tree
    restored_tokens: int  # prefix restored from the store
    logprobs: torch.Tensor  # after each prompt token past the cached prefix
    generated: list[int]
    decode_logprobs: torch.Tensor  # after each generated token

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.restored_tokens


class Frontend:
    """A replica: one model on one "device", its pools, and a linker over a shared store."""

    def __init__(self, engine: ReferenceEngine, linker: Linker) -> None:
        self.engine = engine
        self.linker = linker
        self.views = pool_views(linker.pools)
        self.device = anyio.Lock()  # one forward at a time, as on one accelerator

    async def _on_device(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a forward off the event loop, so offloads and loads of others keep going."""
        async with self.device:
            return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    async def generate(self, request_id: str, prompt: Sequence[int], max_new_tokens: int) -> Completion:
        linker, engine = self.linker, self.engine
        prompt = list(prompt)
        async with linker.session(request_id, prompt) as req:  # releases on exit
            # LOOKUP: device tree match (locked) + store probe above it
            hit = await linker.lookup(req)
            # LOAD + COMMIT: restore the store's part into freshly allocated rows and a slot
            restored = 0
            load = await linker.load(req)  # None: nothing in the store, or no room -> recompute
            if load is not None:
                restored = await linker.commit(load)  # 0: the data failed verification
            prefix = req.prefix_tokens

            # the cached prefix becomes the engine's cache: KV rows + the prefix node's state
            if prefix:
                state = read_boundary(self.views, req.rows[:prefix], req.state_source)
                seq = engine.restore(state, prompt[:prefix])
            else:
                seq = engine.new_sequence()

            # resources for the forward: rows for the prompt, a slot for the checkpoint
            depth = linker.checkpoint_depth(req, len(prompt) - prefix)
            rows = linker.extend(req, len(prompt))
            slot = linker.checkpoint_slot(req) if depth is not None else None

            # forward: prefill on the absolute chunk grid, exporting the state at `depth`
            res = await self._on_device(engine.extend, seq, prompt[prefix:],
                                        export_at=[] if depth is None else [depth])

            # INSERT (+ write-through OFFLOAD): the new tokens' KV/draft rows and the state
            if depth is not None:
                write_boundary(self.views, rows[prefix:depth], slot, res.states[depth],
                               token_start=prefix)
                await linker.insert(req, depth, checkpoint_slot=slot)

            generated, decode_lp = await self._on_device(engine.decode_greedy, seq, max_new_tokens)
        return Completion(request_id, prompt, hit.device_tokens, restored, res.logprobs,
                          generated, decode_lp)


@dataclass
class Session:
    """A chat: its history grows by a user message and the reply every turn."""

    name: str
    history: list[int] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)


SYSTEM_PROMPT = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(99)).tolist()


async def run_session_turns(frontend: Frontend, session: Session, turns: int,
                            gen: torch.Generator, reply_tokens: int, first_turn: int) -> None:
    for k in range(turns):
        n = int(torch.randint(40, 120, (1,), generator=gen))
        message = torch.randint(3, 512, (n,), generator=gen).tolist()
        prompt = (session.history or SYSTEM_PROMPT) + message
        done = await frontend.generate(f"{session.name}/turn{first_turn + k}", prompt, reply_tokens)
        session.completions.append(done)
        session.history = prompt + done.generated
        await anyio.sleep(0)  # the user "types": other sessions run


async def serve(engine: ReferenceEngine, store: Store, *, sessions: int, turns: int,
                reply_tokens: int = 4, seed: int = 0) -> list[Session]:
    """Replica A serves ``turns`` turns of every session, replica B one more."""
    layout = engine.layout(page_size=PAGE_SIZE, chunk_size=CHUNK_TOKENS)
    chats = [Session(f"s{i}") for i in range(sessions)]
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(sessions)]
    longest = len(SYSTEM_PROMPT) + (turns + 1) * (120 + reply_tokens)
    kv_pages = 2 * sessions * (longest // PAGE_SIZE + 2)
    for replica, n_turns, first in (("A", turns, 1), ("B", 1, turns + 1)):
        pools = HybridPools(layout, kv_pages=kv_pages, mamba_slots=4 * sessions)
        async with Linker(layout, pools, store) as linker:
            frontend = Frontend(engine, linker)
            async with anyio.create_task_group() as tg:
                for chat, gen in zip(chats, gens):
                    tg.start_soon(run_session_turns, frontend, chat, n_turns, gen, reply_tokens, first)
            await linker.drain()  # every offload acknowledged before the replica goes away
            linker.check_idle()
            s = linker.statistics()
            print(f"replica {replica}: {s.requests} requests, {s.device_hit_tokens} tokens from the "
                  f"device tree, {s.store_hit_tokens} restored from the store, "
                  f"{s.offloads} offloads")
    return chats


def check_against_recompute(engine: ReferenceEngine, chats: list[Session]) -> list[str]:
    """Every completion must equal a run that never used the cache; returns the mismatches."""
    problems: list[str] = []
    for chat in chats:
        for c in chat.completions:
            seq = engine.new_sequence()
            ref = engine.extend(seq, c.prompt)
            generated, decode_lp = engine.decode_greedy(seq, len(c.generated))
            if not torch.equal(c.logprobs, ref.logprobs[c.cached_tokens:]):
                problems.append(f"{c.request_id}: prompt logprobs differ")
            if generated != c.generated or not torch.equal(decode_lp, c.decode_logprobs):
                problems.append(f"{c.request_id}: generation differs")
    return problems


@dataclass
class ServingRun:
    engine: ReferenceEngine
    chats: list[Session]
    problems: list[str]  # completions that differ from the run without the cache


async def main_async(arch: str, sessions: int, turns: int, seed: int = 0) -> ServingRun:
    t0 = time.perf_counter()
    engine = ReferenceEngine(build_model(arch, seed=seed), build_draft_model(seed=seed + 1),
                             chunk_tokens=CHUNK_TOKENS)
    print(f"{arch} reference model + draft built in {time.perf_counter() - t0:.1f}s")
    store = EmbeddedStore(64 << 20)  # in-process; a MooncakeStore spans machines
    try:
        chats = await serve(engine, store, sessions=sessions, turns=turns, seed=seed)
    finally:
        await store.close()
    print(f"{'request':<12} {'prompt':>6} {'device':>6} {'store':>6} {'computed':>8}")
    for chat in chats:
        for c in chat.completions:
            print(f"{c.request_id:<12} {len(c.prompt):>6} {c.device_tokens:>6} "
                  f"{c.restored_tokens:>6} {len(c.prompt) - c.cached_tokens:>8}")
    return ServingRun(engine, chats, check_against_recompute(engine, chats))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="kimi_linear")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=2, help="turns on replica A (B serves one more)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.turns < 1:
        parser.error("--sessions and --turns must be at least 1")
    problems = anyio.run(main_async, args.arch, args.sessions, args.turns, args.seed).problems
    if problems:
        print("MISMATCH:\n  " + "\n  ".join(problems))
        return 1
    print("every completion is identical to a run without the cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
