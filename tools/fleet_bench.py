"""``hylinker fleet --throughput``: put/get GB/s to another host's Mooncake segment, across a veth
and a bridge, beside the same transfers over loopback.

Both setups run in network namespaces this tool creates (:mod:`hylinker.tools.harness.netns`): a
storage host (``hylinker mooncake segment``) and a client that contributes no segment, so every
byte crosses the transfer engine's TCP transport; ``veth``: master, storage and client each in
a namespace of their own (10.77.0.0/24); ``loopback``: all three in one namespace on
127.0.0.1. The client measures the raw client (``batch_put_from`` / ``batch_get_into`` of
registered buffers) and the runtime's store adapter (:class:`MooncakeStore` ``put`` / ``get``
of registered staging rows), best of ``--repeats``, every read compared with what was written;
it checks from the replicas' endpoints that the objects live on the storage host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import torch

from ..stores.mooncake import MooncakeStore
from ..stores.mooncake_client import MooncakeConfig, import_mooncake_store, setup_client
from ..stores.mooncake_master import MooncakeMaster

MIB = 1 << 20
PORT = 50061


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _raw(cfg: MooncakeConfig, src: torch.Tensor, dst: torch.Tensor, size: int, count: int,
         repeats: int) -> dict[str, float]:
    client = setup_client(import_mooncake_store(), cfg)
    try:
        for t in (src, dst):
            if client.register_buffer(t.data_ptr(), t.numel()) != 0:
                raise RuntimeError("register_buffer failed")
        best_put = best_get = 0.0
        for r in range(repeats):
            keys = [f"raw-{r}-{i}" for i in range(count)]
            ptrs = [src.data_ptr() + i * size for i in range(count)]
            t0 = time.perf_counter()
            codes = client.batch_put_from(keys, ptrs, [size] * count)
            put_s = time.perf_counter() - t0
            if any(c != 0 for c in codes):
                raise RuntimeError(f"raw put failed: {sorted(set(codes))}")
            dst.zero_()
            t0 = time.perf_counter()
            got = client.batch_get_into(keys, [dst.data_ptr() + i * size for i in range(count)], [size] * count)
            get_s = time.perf_counter() - t0
            if any(g != size for g in got) or not torch.equal(src, dst):
                raise RuntimeError("raw get returned other bytes")
            client.batch_remove(keys, True)
            best_put = max(best_put, _gbps(size * count, put_s))
            best_get = max(best_get, _gbps(size * count, get_s))
        for t in (src, dst):
            client.unregister_buffer(t.data_ptr())
    finally:
        client.close()
    return {"raw_put_gbps": best_put, "raw_get_gbps": best_get}


async def _adapter(cfg: MooncakeConfig, src: torch.Tensor, dst: torch.Tensor, size: int, count: int,
                   repeats: int) -> dict[str, Any]:
    store = await MooncakeStore.open(cfg)
    try:
        store.register(src)
        store.register(dst)
        best_put = best_get = 0.0
        endpoints: list[str | None] = []
        exists_ms: list[float] = []
        small_get_ms: list[float] = []
        for r in range(repeats):
            keys = [f"adapter-{r}-{i}" for i in range(count)]
            t0 = time.perf_counter()
            outs = await store.put(keys, [src[i * size:(i + 1) * size] for i in range(count)])
            put_s = time.perf_counter() - t0
            if any(o.name != "OK" for o in outs):
                raise RuntimeError(f"adapter put failed: {sorted({o.name for o in outs})}")
            endpoints = await store.replica_endpoints(keys)
            dst.zero_()
            t0 = time.perf_counter()
            got = await store.get(keys, [dst[i * size:(i + 1) * size] for i in range(count)])
            get_s = time.perf_counter() - t0
            if any(g.outcome.name != "OK" for g in got) or not torch.equal(src, dst):
                raise RuntimeError("adapter get returned other bytes")
            for k in keys[:32]:  # one-key calls: the round trip each call pays
                t0 = time.perf_counter()
                await store.exists([k])
                exists_ms.append((time.perf_counter() - t0) * 1e3)
            for i in range(min(32, count)):
                t0 = time.perf_counter()
                await store.get([keys[i]], [dst[i * size:(i + 1) * size]])
                small_get_ms.append((time.perf_counter() - t0) * 1e3)
            await store.remove(keys)
            best_put = max(best_put, _gbps(size * count, put_s))
            best_get = max(best_get, _gbps(size * count, get_s))
    finally:
        await store.close()
    hosts = sorted({(e or "none").rpartition(":")[0] for e in endpoints})
    return {"store_put_gbps": best_put, "store_get_gbps": best_get, "object_hosts": hosts,
            "exists_call_ms_p50": round(float(np.median(exists_ms)), 2),
            "one_object_get_ms_p50": round(float(np.median(small_get_ms)), 2)}


async def _runtime(cfg: MooncakeConfig, docs: int) -> dict[str, Any]:
    """The whole runtime: ``docs`` prefills of 512 tokens (8 KV pages and a ~1 MiB state each,
    the stress tool's Kimi-like geometry) offloaded, the device tree flushed, then all of them
    restored at once and checked byte for byte."""
    from ..components.keys import page_keys
    from ..components.pools import HybridPools
    from ..runtime.linker.config import LinkerConfig
    from ..runtime.linker.facade import Linker
    from ..testing.content import SyntheticContent, preset_layout
    from .harness.fleet_engine import document

    layout = preset_layout("kimi", 64, 64)
    P = layout.page_size
    pools = HybridPools(layout, kv_pages=docs * 8 + 64, mamba_slots=3 * docs + 4)
    content = SyntheticContent(pools, seed=0)
    store = await MooncakeStore.open(cfg)
    prompts = [document(d, 8 * P) for d in range(docs)]
    wrong = 0
    misses: list[int] = []
    try:
        async with Linker(layout, pools, store, LinkerConfig(touch=False)) as lk:
            t0 = time.perf_counter()
            writing = 0.0  # the synthetic forward's writes: not the runtime's time
            for d, tokens in enumerate(prompts):
                async with lk.session(f"w{d}", tokens) as req:
                    await lk.lookup(req)
                    rows = lk.extend(req, len(tokens))
                    keys = page_keys(req.tokens, P, req.seed)
                    lk.working_slot(req)
                    slot = lk.checkpoint_slot(req)
                    w0 = time.perf_counter()
                    content.write_pages(keys, rows[: len(keys) * P])
                    content.write_state(keys[-1], slot)
                    writing += time.perf_counter() - w0
                    await lk.insert(req, len(tokens), checkpoint_slot=slot)
            await lk.drain()
            put_s = time.perf_counter() - t0 - writing
            lk.flush_device()
            restored: list[Any] = []
            all_in = anyio.Event()
            checked = anyio.Event()

            def arrived(req: Any | None, d: int) -> None:
                if req is None:
                    misses.append(d)
                else:
                    restored.append(req)
                if len(restored) + len(misses) == docs:
                    all_in.set()

            async def restore(d: int) -> None:
                # one token past the document: a prompt's own last token is always recomputed
                async with lk.session(f"r{d}", np.append(prompts[d], 7).astype(np.int32)) as req:
                    await lk.lookup(req)
                    load = await lk.load(req)
                    if load is None:
                        arrived(None, d)
                        return
                    await load.wait()
                    arrived(req if await lk.commit(load) == 8 * P else None, d)
                    await checked.wait()  # keep the rows until they are checked

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for d in range(docs):
                    tg.start_soon(restore, d)
                await all_in.wait()
                get_s = time.perf_counter() - t0
                for req in restored:  # every restored byte, after the timing
                    keys = page_keys(req.tokens, P, req.seed)
                    n = req.prefix_pages
                    wrong += len(content.pages_match(keys[:n], req.rows[: n * P]))
                    if req.state_source is None or not content.state_matches(keys[n - 1], req.state_source):
                        wrong += 1
                checked.set()
            stats = lk.pool_statistics()
    finally:
        await store.close()
    put_bytes = sum(s.bytes_offloaded for s in stats.values())
    get_bytes = sum(s.bytes_loaded for s in stats.values())
    if wrong:
        raise RuntimeError(f"{wrong} restores differ from what was written")
    return {"runtime_put_gbps": _gbps(put_bytes, put_s), "runtime_get_gbps": _gbps(get_bytes, get_s),
            "runtime_bytes": put_bytes, "runtime_restores_verified": docs - len(misses),
            "runtime_misses": len(misses), "runtime_linker": attrs.asdict(lk.statistics())}


def child(master: str, address: str, object_kib: int, count: int, repeats: int) -> dict[str, Any]:
    """The client side (runs inside the client's namespace)."""
    size = object_kib * 1024
    cfg = MooncakeConfig(master_address=master, local_hostname=address, segment_bytes=0,
                         local_buffer_bytes=16 * MIB)
    src = torch.randint(0, 256, (size * count,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    out: dict[str, Any] = {"object_bytes": size, "objects": count, "repeats": repeats}
    out.update(_raw(cfg, src, dst, size, count, repeats))
    out.update(anyio.run(_adapter, cfg, src, dst, size, count, repeats))
    out.update(anyio.run(_runtime, cfg, count // 2))
    return out


def _segment(command: list[str], master: str, hostname: str, mib: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*command, sys.executable, "-m", "hylinker", "mooncake", "segment", "--master", master,
         "--segment-mib", str(mib), "--hostname", hostname],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "mounted" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the storage host did not mount its segment")


def measure(setup: str, object_kib: int, count: int, repeats: int) -> dict[str, Any]:
    """One setup (``veth`` or ``loopback``): master, storage host, client; the client's figures."""
    from .harness.fleet import netns_port_accepts
    from .harness.netns import Network

    roles = ["master", "store", "client"] if setup == "veth" else ["client"]
    with Network(roles) as net:
        client_host = net.hosts["client"]
        mhost = net.hosts["master"] if setup == "veth" else client_host
        store_host = net.hosts["store"] if setup == "veth" else client_host
        maddr = mhost.address if setup == "veth" else "127.0.0.1"
        saddr = store_host.address if setup == "veth" else "127.0.0.1"
        caddr = client_host.address if setup == "veth" else "127.0.0.1"
        ns = mhost.netns
        master = MooncakeMaster(host=maddr, rpc_port=PORT, metrics_port=PORT + 1,
                                launcher=["ip", "netns", "exec", ns],
                                probe=lambda h, p, t: netns_port_accepts(ns, h, p, t))
        with master:
            seg = _segment(["ip", "netns", "exec", store_host.netns], master.address, saddr,
                           2 * object_kib * count // 1024 + 64)
            try:
                done = subprocess.run(
                    client_host.command([sys.executable, "-m", "hylinker.tools.fleet_bench", "--child",
                                         master.address, caddr, str(object_kib), str(count), str(repeats)]),
                    capture_output=True, text=True, timeout=300)
            finally:
                seg.terminate()
                seg.wait(timeout=10)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("@@")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{setup} client failed: {done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(lines[-1][2:])
        result["setup"] = setup
        result["storage_address"] = saddr
        return result


def throughput(object_kib: int = 1024, count: int = 64, repeats: int = 3) -> list[dict[str, Any]]:
    return [measure(s, object_kib, count, repeats) for s in ("veth", "loopback")]


def main(argv: Sequence[str]) -> int:
    """The client host's process (``--child``); people run ``hylinker fleet --throughput``."""
    if argv[:1] != ["--child"]:
        raise SystemExit("fleet_bench runs as the client host's process; run `hylinker fleet --throughput`")
    master, address, kib, count, repeats = argv[1:6]
    print("@@" + json.dumps(child(master, address, int(kib), int(count), int(repeats))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
