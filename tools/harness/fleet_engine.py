"""One fleet host's engine process: a :class:`~hylinker.runtime.linker.facade.Linker` on a Mooncake
client that contributes a segment, serving its own stream of requests with synthetic content.

Run inside a host's namespace by :mod:`.fleet` (``python -m hylinker.tools.harness.fleet_engine``).
Every request is one of ``--docs`` shared documents (the same token ids on every host) plus a
tail of its own, so a document one host computed and offloaded is a store hit on the other. The
device tree is flushed after every request: every hit is a store hit, read through Mooncake.
Every restored page and state is compared byte for byte with its synthetic content
(:class:`~hylinker.testing.content.Content`).

Protocol: one JSON object per line on stdout, prefixed ``@@`` (``ready``; ``req`` per request;
``offloading`` before the offloads of a request are drained; ``end`` with leak checks after
``stop`` arrives on stdin). Which path each transfer took is found from the replica's transport
endpoint (:meth:`~hylinker.stores.mooncake.MooncakeStore.replica_endpoints`): this host's own
address is a local memcpy, another host's is TCP across the veth.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import torch

from ...components.keys import page_keys
from ...components.pools import HybridPools, PoolError
from ...runtime.linker.config import LinkerConfig
from ...runtime.linker.facade import Linker
from ...stores.base import GetResult, Outcome, Store
from ...stores.mooncake import MooncakeStore
from ...stores.mooncake_client import MooncakeConfig
from ...stores.resilient import ResiliencePolicy
from ...testing.content import SyntheticContent, preset_layout
from ...testing.fakes import GatedStore

MIB = 1 << 20


def emit(event: str, **fields: Any) -> None:
    print("@@" + json.dumps({"ev": event, "t": time.monotonic(), **fields}), flush=True)


class PathRecorder(GatedStore):
    """A pass-through :class:`~.fakes.GatedStore` (nothing held) that also remembers the keys
    this request put and got with ``OK``, and forwards scatter-gather (so the runtime moves
    large objects in place, as it does on Mooncake directly)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.read_keys: list[str] = []
        self.stored_keys: list[str] = []

    async def put(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[Outcome]:
        out = await super().put(keys, buffers)
        self.stored_keys.extend(k for k, o in zip(keys, out) if o is Outcome.OK)
        return out

    async def get(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> list[GetResult]:
        out = await super().get(keys, buffers)
        self.read_keys.extend(k for k, r in zip(keys, out) if r.outcome is Outcome.OK)
        return out

    async def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[Outcome]:
        out: list[Outcome] = await self.inner.put_parts(keys, parts)  # type: ignore[attr-defined]
        self.stored_keys.extend(k for k, o in zip(keys, out) if o is Outcome.OK)
        return out

    async def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[torch.Tensor]]) -> list[GetResult]:
        out: list[GetResult] = await self.inner.get_parts(keys, parts)  # type: ignore[attr-defined]
        self.read_keys.extend(k for k, r in zip(keys, out) if r.outcome is Outcome.OK)
        return out


@attrs.define
class EngineArgs:
    name: str
    master: str
    address: str
    seed: int = 0
    docs: int = 12
    doc_pages: int = 8
    segment_mib: int = 64
    call_timeout_s: float = 1.0
    deadline_s: float = 2.0
    think_s: float = 0.02
    transfer_timeout_s: int = 1
    probe_paths: bool = True


def _parse(argv: Sequence[str] | None) -> EngineArgs:
    p = argparse.ArgumentParser(prog="python -m hylinker.tools.harness.fleet_engine")
    for f in attrs.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, type=int, default=1 if f.default else 0)
        elif f.default is attrs.NOTHING:
            p.add_argument(flag, required=True)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    ns = p.parse_args(argv)
    values = vars(ns)
    values["probe_paths"] = bool(values["probe_paths"])
    return EngineArgs(**values)


def document(d: int, tokens: int) -> np.ndarray:
    """Document ``d``'s token ids: the same on every host."""
    return np.random.default_rng(1_000_003 + d).integers(1, 30000, size=tokens).astype(np.int32)


class Engine:
    def __init__(self, args: EngineArgs, store: MooncakeStore) -> None:
        self.args = args
        self.mooncake = store
        self.store = PathRecorder(store)
        self.layout = preset_layout("kimi", 64, 64)
        self.pools = HybridPools(self.layout, kv_pages=256, mamba_slots=16)
        self.content = SyntheticContent(self.pools, seed=0)  # the same bytes on every host
        self.doc_tokens = args.doc_pages * self.layout.page_size
        self.docs = [document(d, self.doc_tokens) for d in range(args.docs)]
        self.rng = np.random.default_rng(args.seed)
        self.stop = threading.Event()
        policy = ResiliencePolicy(call_timeout_s=args.call_timeout_s, deadline_s=args.deadline_s,
                                  close_grace_s=0.5)
        self.config = LinkerConfig(resilience=policy, close_timeout_s=args.deadline_s, touch=False)

    async def run(self) -> None:
        n = 0
        async with Linker(self.layout, self.pools, self.store, self.config) as lk:
            emit("ready", name=self.args.name, address=self.args.address)
            while not self.stop.is_set():
                n += 1
                await self.serve(lk, n)
                await anyio.sleep(self.args.think_s)
            await lk.drain()
            pages, slots = lk.leaked()
            locked = len(lk.tree.tree.locked_nodes())
            idle_error = ""
            try:
                lk.check_idle()
                lk.flush_device()
                self.pools.check_idle()
            except PoolError as exc:
                idle_error = str(exc)
            stats = attrs.asdict(lk.statistics())
            resilience = lk.resilience_statistics()
            t0 = time.monotonic()
        linker_close_s = time.monotonic() - t0
        emit("end", name=self.args.name, requests=n, leaked_rows=pages * self.layout.page_size,
             leaked_slots=slots, locked_nodes=locked, idle_error=idle_error, linker_close_s=linker_close_s,
             stats=stats, resilience=attrs.asdict(resilience) if resilience is not None else None)

    async def serve(self, lk: Linker, n: int) -> None:
        d = int(self.rng.integers(len(self.docs)))
        tail = self.rng.integers(1, 30000, size=int(self.rng.integers(64, 128))).astype(np.int32)
        tokens = np.concatenate([self.docs[d], tail])
        P = self.layout.page_size
        self.store.read_keys.clear()
        self.store.stored_keys.clear()
        t_start = time.monotonic()
        failed_before = self.store_failures(lk)
        lookup_s = load_s = None
        restored = 0
        wrong = 0
        async with lk.session(f"{self.args.name}-{n}", tokens) as req:
            t0 = time.monotonic()
            hit = await lk.lookup(req)
            lookup_s = time.monotonic() - t0
            if hit.store_tokens:
                t0 = time.monotonic()
                load = await lk.load(req)
                if load is not None:
                    await load.wait()
                    restored = await lk.commit(load)
                load_s = time.monotonic() - t0
            keys = page_keys(req.tokens, P, req.seed)
            k = req.prefix_pages
            if k:
                wrong = len(self.content.pages_match(keys[:k], req.rows[: k * P]))
                if req.state_source is None or not self.content.state_matches(keys[k - 1], req.state_source):
                    wrong += 1
            rows = lk.extend(req, len(tokens))
            whole = len(tokens) // P
            self.content.write_pages(keys[k:whole], rows[k * P: whole * P])
            lk.working_slot(req)
            for depth in self.depths(k * P, len(tokens)):
                slot = lk.checkpoint_slot(req)
                self.content.write_state(keys[depth // P - 1], slot)
                await lk.insert(req, depth, checkpoint_slot=slot)
        emit("offloading", n=n)
        t0 = time.monotonic()
        drained = False
        with anyio.move_on_after(self.args.call_timeout_s):  # an offload stuck in the client
            await lk.drain()                                 # must not stop this host serving
            drained = True
        drain_s = time.monotonic() - t0
        if drained:
            lk.flush_device()  # the next hit comes from the store
        # the probe is one more master call: not while this host's calls are failing
        paths = await self.paths() if self.args.probe_paths and drained else {}
        unanswered = self.store_failures(lk) - failed_before
        emit("req", n=n, start=t_start, doc=d, prompt=len(tokens), store_hit=hit.store_tokens,
             restored=restored, recomputed=bool(hit.store_tokens and not restored), wrong=wrong,
             lookup_s=lookup_s, unanswered=unanswered, load_s=load_s, drain_s=drain_s,
             drained=drained, **paths)

    @staticmethod
    def store_failures(lk: Linker) -> int:
        """Store calls and keys so far that got no answer: calls cut at their timeout, failed
        unavailable or refused by the open breaker, keys still failing after every attempt."""
        r = lk.resilience_statistics()
        return 0 if r is None else r.timeouts + r.unavailable + r.rejected_calls + r.exhausted_keys

    def depths(self, cached: int, prompt: int) -> list[int]:
        """Where this prefill donates states: the document's end (unless cached) and the
        prompt's last grid boundary, so every request offloads pages and a state of its own."""
        grid = self.layout.grid
        out = [self.doc_tokens] if cached < self.doc_tokens else []
        last = prompt // grid * grid
        if last > max(cached, self.doc_tokens):
            out.append(last)
        return out

    async def paths(self) -> dict[str, int]:
        """How many objects this request got / put through a memcpy (own segment) or TCP."""
        out = {"get_local": 0, "get_remote": 0, "put_local": 0, "put_remote": 0}
        keys = self.store.read_keys + self.store.stored_keys
        if not keys:
            return out
        with anyio.move_on_after(self.args.call_timeout_s):
            endpoints = await self.mooncake.replica_endpoints(keys)
            for i, ep in enumerate(endpoints):
                if ep is None:
                    continue
                side = "local" if ep.rpartition(":")[0] == self.args.address else "remote"
                out[f"{'get' if i < len(self.store.read_keys) else 'put'}_{side}"] += 1
        return out


def _watch_stdin(stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()  # "stop", or the controller went away


async def _main(args: EngineArgs) -> int:
    cfg = MooncakeConfig(master_address=args.master, local_hostname=args.address,
                         segment_bytes=args.segment_mib * MIB, local_buffer_bytes=16 * MIB,
                         transfer_timeout_s=args.transfer_timeout_s)
    store = await MooncakeStore.open(cfg)
    engine = Engine(args, store)
    threading.Thread(target=_watch_stdin, args=(engine.stop,), daemon=True).start()
    try:
        await engine.run()
    finally:
        t0 = time.monotonic()
        await store.close()
        emit("closed", name=args.name, store_close_s=time.monotonic() - t0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return anyio.run(_main, _parse(argv))


if __name__ == "__main__":
    sys.exit(main())
