"""The code map of a request's lifecycle (``docs/design/lifecycle.md``) names exactly the modules
each phase enters: one request through the ``Linker`` is traced (every call into hylinker, the
store's worker threads included) and each phase's set of modules is compared with its section.

A generator or coroutine frame counts once, where it starts: a task started before the phase (a
pool actor's loop, the touch batcher) that only resumes during it adds nothing; what it calls
during the phase counts.
"""

from __future__ import annotations

import dis
import inspect
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import numpy as np

import hylinker
from hylinker.components.pools import HybridPools
from hylinker.runtime.linker.config import LinkerConfig
from hylinker.runtime.linker.facade import Linker
from hylinker.stores.embedded import EmbeddedStore
from hylinker.testing.content import SyntheticContent
from hylinker.testing.fakes import small_hybrid_layout, synthetic_prefill

MAP = Path(os.path.realpath(os.path.dirname(hylinker.__file__))) / "docs" / "design" / "lifecycle.md"
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_RESUME = dis.opmap.get("RESUME")  # 3.11+: its argument is 0 where a frame starts


def resumed(frame: FrameType) -> bool:
    """A generator or coroutine frame entered again after a yield or an await."""
    if not frame.f_code.co_flags & _RESUMABLE or frame.f_lasti < 0:
        return False
    code = frame.f_code.co_code
    return _RESUME is None or code[frame.f_lasti] != _RESUME or code[frame.f_lasti + 1] & 3 != 0


class PhaseTrace:
    """The hylinker modules (test kit aside) each phase enters, in first-entry order."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.modules: dict[str, dict[str, None]] = {}

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or resumed(frame):
            return  # a resumption counts where its frame started
        module = frame.f_globals.get("__name__", "")
        if self.phase and module.startswith("hylinker.") and not module.startswith("hylinker.testing"):
            self.modules.setdefault(self.phase, {})[module.removeprefix("hylinker.")] = None

    @contextmanager
    def installed(self) -> Iterator[PhaseTrace]:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


async def one_request(trace: PhaseTrace) -> None:
    """A donor fills the store; a second replica (empty device) restores, extends, offloads; a
    third request hits its device tree (TOUCH)."""
    layout = small_hybrid_layout()
    store = EmbeddedStore(8 << 20)
    tokens = np.arange(1000, 1107, dtype=np.int64)
    for replica in (0, 1):
        pools = HybridPools(layout, kv_pages=64, mamba_slots=16)
        # touches are queued, never sent while the test runs: a batch sent in the middle of a
        # phase would add the store's touch to whichever phase the loop happened to be in
        linker = Linker(layout, pools, store, LinkerConfig(touch_batch_s=60.0))
        content = SyntheticContent(pools)
        async with linker:
            await anyio.sleep(0.01)  # the linker's own tasks start before any phase
            traced = replica == 1
            req = linker.request(f"r{replica}", tokens if traced else tokens[:67])
            trace.phase = "LOOKUP" if traced else None
            await linker.lookup(req)
            trace.phase = "LOAD" if traced else None
            load = await linker.load(req)
            assert (load is not None) == traced
            if load is not None:
                assert await load.wait()
                trace.phase = "COMMIT"
                assert await linker.commit(load) == 64
            trace.phase = "INSERT" if traced else None
            await synthetic_prefill(linker, content, req)
            await linker.release(req)
            await linker.drain()
            trace.phase = None
            if traced:
                hit = linker.request("r2", tokens)
                trace.phase = "TOUCH"
                assert (await linker.lookup(hit)).device_tokens > 0
                trace.phase = None
                await linker.release(hit)
                await linker.drain()
            linker.check_idle()


def documented(text: str) -> dict[str, tuple[int, set[str]]]:
    """Phase -> (the module count its heading states, the modules its section names)."""
    sections = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        heading = section.splitlines()[0]
        count = re.search(r"\((\d+) modules\)", heading)
        assert count, f"a phase heading states its module count: {heading!r}"
        paths = re.findall(r"`([\w/]+)\.py`", section)
        sections[heading.split()[0]] = (int(count.group(1)), {p.replace("/", ".") for p in paths})
    return sections


def test_the_lifecycle_map_names_every_module_each_phase_enters() -> None:
    trace = PhaseTrace()
    with trace.installed():
        anyio.run(one_request, trace)
    mapped = documented(MAP.read_text(encoding="utf-8"))
    assert set(mapped) == set(trace.modules) == {"LOOKUP", "LOAD", "COMMIT", "INSERT", "TOUCH"}
    for phase, entered in trace.modules.items():
        count, named = mapped[phase]
        assert set(entered) == named, (
            f"{phase}: entered but not mapped {sorted(set(entered) - named)}, "
            f"mapped but not entered {sorted(named - set(entered))} (docs/design/lifecycle.md)")
        assert count == len(entered), f"{phase}: the heading says {count}, the trace {len(entered)}"


def test_a_resumed_coroutine_is_told_from_a_started_one() -> None:
    seen: list[bool] = []

    async def twice() -> None:
        await anyio.sleep(0)
        await anyio.sleep(0)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is twice.__code__:
            seen.append(resumed(frame))

    sys.setprofile(profile)
    try:
        anyio.run(twice)
    finally:
        sys.setprofile(None)
    assert seen[0] is False and seen[1:] and all(seen[1:])


def test_a_stale_map_is_caught() -> None:
    text = "# map\n## LOAD (2 modules)\n1. `runtime/linker/facade.py`\n2. `stores/base.py`\n"
    assert documented(text) == {"LOAD": (2, {"runtime.linker.facade", "stores.base"})}
