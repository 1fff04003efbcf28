"""``hylinker demo``: a multi-turn agentic conversation on the reference hybrid model.

Every turn goes through the runtime (LOOKUP → LOAD → COMMIT → forward → INSERT → OFFLOAD)
with the device tree flushed before it, so every cached token comes back from the store.
Before each lookup the demo waits for the previous turns' offloads to settle, so the store
holds what it will ever hold of them; each turn must restore exactly what the store's probe
found at its lookup, and a checkpoint a turn donated that the store lacks must be explained by
a counted loss (an offload dropped by the latency watermark, skipped by backpressure, failed;
an object the store evicted).
Each turn is also recomputed from scratch on the same chunk schedule: the two must give the
very same logprobs (max |Δ| = 0, KL = 0). Last come the negative controls
(``tools/demo_controls.py``): the last prompt restored with part of its state taken from
another prefix must move the output by at least a stated margin, or the run fails.

``--large`` replays a conversation of thousands of tokens (a long system prompt, tool
results), where restoring the prefix beats recomputing it, and reports the time-to-first-token
ratio recompute / restore.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from .arguments import MOONCAKE_INSTALL, UsageError, int_at_least, positive_int, require_package

HELP = "multi-turn agentic chat on the reference hybrid model; restores must be bit-exact"

STORES = ("embedded", "mooncake")
PAGE_SIZE = 16
CHUNK_TOKENS = 64
MIB = 1 << 20


@attrs.frozen
class ConversationShape:
    """How long the conversation's parts are (tokens)."""

    system_tokens: int
    message_tokens: tuple[int, int]  # each turn's new user message / tool result: [lo, hi]
    response_tokens: int  # greedy-decoded assistant reply appended after each turn
    turns: int


DEFAULT_SHAPE = ConversationShape(system_tokens=128, message_tokens=(48, 144), response_tokens=8, turns=4)
LARGE_SHAPE = ConversationShape(system_tokens=2048, message_tokens=(96, 192), response_tokens=8, turns=3)


def configure(parser: argparse.ArgumentParser) -> None:
    from .harness.reference.models import DEFAULT_ARCH, SUPPORTED_ARCHS

    parser.add_argument("--arch", default=DEFAULT_ARCH,
                        help=f"transformers model type with recurrent layers (default {DEFAULT_ARCH}; "
                             f"{', '.join(SUPPORTED_ARCHS)} are in the fast tests, docs/figures/exactness.md "
                             "lists every hybrid type transformers ships and what it does)")
    parser.add_argument("--turns", type=positive_int, default=None,
                        help=f"conversation turns (default {DEFAULT_SHAPE.turns}, "
                             f"{LARGE_SHAPE.turns} with --large)")
    parser.add_argument("--store", choices=STORES, default="embedded",
                        help="where offloaded prefixes live (mooncake starts a loopback master)")
    parser.add_argument("--large", action="store_true",
                        help=f"a conversation of thousands of tokens (a {LARGE_SHAPE.system_tokens}-"
                             "token system prompt): restoring clearly beats recomputing")
    parser.add_argument("--system-tokens", type=int_at_least(0), default=None, metavar="N",
                        help=f"length of the system prompt that opens turn 1 (default "
                             f"{DEFAULT_SHAPE.system_tokens}, {LARGE_SHAPE.system_tokens} with "
                             "--large); e.g. --large --system-tokens 16384 for 16 K-token prompts")
    parser.add_argument("--real-shape", action="store_true",
                        help="the real checkpoint's cache geometry (qwen3_next: Qwen3-Next-80B-A3B's 48 "
                             "layers; kimi_linear: Kimi-Linear-48B's 27), hidden size and experts shrunk")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the per-turn figures here")


def run(args: argparse.Namespace) -> int:
    require_package("transformers", "hylinker demo", "pip install 'hylinker[reference]'")
    if args.store == "mooncake":
        require_package("mooncake.store", "--store mooncake", MOONCAKE_INSTALL)
    shape = LARGE_SHAPE if args.large else DEFAULT_SHAPE
    if args.turns is not None:
        shape = attrs.evolve(shape, turns=args.turns)
    if args.system_tokens is not None:
        shape = attrs.evolve(shape, system_tokens=args.system_tokens)
    import anyio

    try:
        overrides = None
        if args.real_shape:
            from .harness.shapes import transformers_overrides

            overrides = transformers_overrides(args.arch)
        report = anyio.run(_run_with_store, args.arch, args.store, shape, args.seed, args.large, overrides)
    except (ValueError, DemoSetupError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0 if report["passed"] else 1


class DemoSetupError(RuntimeError):
    """The demo cannot start (unknown model type, mooncake missing, ...)."""


async def _run_with_store(arch: str, store_kind: str, shape: ConversationShape, seed: int,
                          large: bool, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    from ..stores.registry import StoreSpec, open_store
    from .harness.reference.models import UnsupportedModelError

    if store_kind == "embedded":  # real shapes: states of tens of MB
        spec = StoreSpec("embedded", (2048 if overrides else 256) * MIB)
    else:
        spec = StoreSpec(store_kind, 128 * MIB, mooncake={"workers": 2})
    try:
        opened = await open_store(spec)
    except (ImportError, OSError, RuntimeError) as exc:
        raise DemoSetupError(f"cannot start the {store_kind} store: {exc}") from exc
    store, master = opened.store, opened.master
    try:
        return await run_demo(arch, shape, store=store, store_name=store_kind, seed=seed, large=large,
                              model_overrides=overrides)
    except UnsupportedModelError as exc:
        raise DemoSetupError(str(exc)) from exc
    finally:
        await store.close()
        if master is not None:
            master.close()


def _messages(shape: ConversationShape, vocab: int, seed: int) -> list[list[int]]:
    """Turn ``k``'s new tokens (turn 0 starts with the system prompt)."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + seed)
    lo, hi = shape.message_tokens
    out: list[list[int]] = []
    for k in range(shape.turns):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        if k == 0:
            n += shape.system_tokens
        out.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
    return out


async def run_demo(
    arch: str,
    shape: ConversationShape,
    *,
    store: Any,
    store_name: str = "embedded",
    seed: int = 0,
    large: bool = False,
    engine: Any = None,
    warmup: bool = True,
    out: Callable[[str], None] = print,
    config: Any = None,
    before_turn: Callable[[int, Any], Awaitable[None]] | None = None,
    model_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the conversation on ``store``; print the table; return the JSON report.

    ``engine``: a prebuilt :class:`ReferenceEngine` (with a draft model) to reuse.
    ``warmup``: first run one forward over the longest prompt, so that one-time setup of each
    chunk shape (several times a warm prefill on CPU) is billed to neither side of the ttft.
    ``config``: the :class:`LinkerConfig` (default: the production defaults).
    ``before_turn(k, linker)``: awaited before turn ``k``'s lookup (1-based), once the offloads
    of the turns before settled; tests use it to make the store fail or the latency watermark
    drop an offload.
    ``model_overrides``: config fields over the tiny config (``--real-shape``: a real geometry).
    """
    import anyio
    import torch

    from ..components.mamba import restorable_ceiling
    from ..components.pools import HybridPools
    from ..runtime.linker.facade import Linker
    from .demo_controls import CONTROLS, MARGIN, ControlResult, measure, other_prefix
    from .harness.reference import (
        ReferenceEngine,
        build_draft_model,
        build_model,
        kl_divergence,
        max_abs_diff,
    )
    from .harness.reference.runtime_engine import LinkedEngine
    from .report import format_table

    t_build = time.perf_counter()
    if engine is None:
        from .harness.reference import cache_geometry

        model = build_model(arch, seed=seed, **(model_overrides or {}))
        # the draft model's KV rides on the target's attention rows: none for a purely
        # recurrent model (a state-only layout), which runs without a draft
        draft = build_draft_model(seed=seed + 1) if cache_geometry(model).kv is not None else None
        engine = ReferenceEngine(model, draft, chunk_tokens=CHUNK_TOKENS)
    build_s = time.perf_counter() - t_build
    if not engine.geometry.linear:
        from .harness.reference import UnsupportedModelError

        raise UnsupportedModelError(
            f"{engine.geometry.model_type}: no layer holds a recurrent state; the demo restores "
            "hybrid models (its checkpoint grid and chunk schedule assume recurrent layers)")
    layout = engine.layout(page_size=PAGE_SIZE, chunk_size=CHUNK_TOKENS)
    g = engine.geometry
    vocab = int(engine.model.config.get_text_config().vocab_size)
    messages = _messages(shape, vocab, seed)
    longest = sum(len(m) for m in messages) + shape.response_tokens * shape.turns
    t_warm = time.perf_counter()
    if warmup:
        engine.extend(engine.new_sequence(), [3] * longest)
    warm_s = time.perf_counter() - t_warm
    device = next(engine.model.parameters()).device  # the pools live where the model runs
    pools = HybridPools(layout, kv_pages=2 * (-(-longest // PAGE_SIZE)) + 8, mamba_slots=8, device=device)
    out(f"hylinker demo: {g.model_type} reference model ({g.num_layers} layers: "
        f"{len(g.linear)} linear-attention, {len(g.full_layers)} full-attention) + "
        f"{'a llama draft model' if engine.draft_model is not None else 'no draft model'}, "
        f"fp32 {'CPU' if device.type == 'cpu' else device}, built in {build_s:.1f}s"
        + (f", warmed up over {longest} tokens in {warm_s:.1f}s" if warmup else ""))
    out(f"store: {store_name}; page {layout.page_size} tokens, checkpoint grid {layout.grid}, "
        f"chunk schedule {engine.chunk_tokens} tokens on the absolute grid")
    out("the device tree is flushed before every turn: every cached token is restored from the store")

    turns: list[dict[str, Any]] = []
    donated: list[int] = []
    history: list[int] = []
    last_ref: torch.Tensor | None = None
    controls = [c for c in CONTROLS if c.applies(g)]
    results: list[ControlResult] = []
    async with Linker(layout, pools, store, config=config) as linker:
        # every forward (prefill, recompute, decode) runs in a worker thread, as a serving
        # engine's does: on the event loop it would stall the completion of the store calls in
        # flight, and the store-latency watermark would read the model's seconds as a slow
        # store and drop offloads
        served = LinkedEngine(engine, linker, forward_in_thread=True)
        losses_before = _offload_losses(linker, store)
        for k, message in enumerate(messages):
            prompt = history + message
            t_settle = time.perf_counter()
            await linker.drain()  # every offload of the turns before has settled
            settle_s = time.perf_counter() - t_settle
            if before_turn is not None:
                await before_turn(k + 1, linker)
            losses = _offload_losses(linker, store)
            turn_losses = {name: losses[name] - losses_before[name] for name in losses}
            losses_before = losses
            linker.flush_device()
            ceiling = restorable_ceiling(len(prompt), layout.grid)
            donated_below = max((d for d in donated if d <= ceiling), default=0)
            c0 = time.process_time()
            res = await served.prefill(f"turn{k + 1}", prompt)
            cpu_restore = time.process_time() - c0  # includes donating the turns' checkpoints
            t0, c0 = time.perf_counter(), time.process_time()
            # off the loop too: the turn's offloads are in flight meanwhile
            ref = await anyio.to_thread.run_sync(served.recompute, prompt)
            ttft_recompute = time.perf_counter() - t0
            cpu_recompute = time.process_time() - c0
            want = ref.logprobs[res.cached_tokens:]
            draft_diff = None
            if res.draft_logprobs is not None and ref.draft_logprobs is not None:
                draft_diff = max_abs_diff(res.draft_logprobs, ref.draft_logprobs[res.cached_tokens:])
            donated.extend(res.checkpoints)
            reply, _ = await anyio.to_thread.run_sync(
                engine.decode_greedy, res.sequence, shape.response_tokens)
            history = prompt + reply
            last_ref = ref.logprobs
            turns.append({
                "turn": k + 1,
                "prompt_tokens": len(prompt),
                "restored_tokens": res.restored_tokens,
                # what the store's probe found at this turn's lookup (offloads settled before it)
                "expected_restored_tokens": res.store_tokens,
                # the deepest checkpoint the turns before donated that this prompt could restore
                "donated_tokens": donated_below,
                "offload_losses_before": turn_losses,
                "settle_wait_s": settle_s,
                "recomputed_tokens": res.computed_tokens,
                "max_abs_logprob_diff": max_abs_diff(res.logprobs, want),
                "draft_max_abs_logprob_diff": draft_diff,
                "kl": kl_divergence(want, res.logprobs),
                "ttft_restore_s": res.ttft_s,
                "ttft_recompute_s": ttft_recompute,
                "restore_phases_s": dict(res.phases_s),
                # CPU seconds of this process (all threads): robust where wall time is not, on
                # a machine shared with other work
                "cpu_restore_s": cpu_restore,
                "cpu_recompute_s": cpu_recompute,
            })
        # negative controls: the last prompt again, part of its restored state from another prefix
        assert last_ref is not None
        last_prompt = history[: turns[-1]["prompt_tokens"]]
        other = other_prefix(len(last_prompt), vocab, seed)
        for control in controls:
            await linker.drain()
            linker.flush_device()
            neg = await served.prefill(f"negative-control-{control.name}", last_prompt,
                                       corrupt=control.corrupt(engine, other))
            results.append(measure(control, neg.restored_tokens,
                                   last_ref[neg.cached_tokens:] if neg.cached_tokens else None,
                                   neg.logprobs))
        await linker.drain()
        stats = linker.statistics()
        final_losses = _offload_losses(linker, store)

    rows = [{
        **t,
        "lost": sum(t["offload_losses_before"].values()),
        "ttft_restore_ms": 1e3 * t["ttft_restore_s"],
        "ttft_recompute_ms": 1e3 * t["ttft_recompute_s"],
        "speedup": t["ttft_recompute_s"] / t["ttft_restore_s"],
    } for t in turns]
    out("")
    out(format_table(rows, [
        ("turn", "turn"), ("prompt_tokens", "prompt"), ("restored_tokens", "restored"),
        ("expected_restored_tokens", "in store"), ("donated_tokens", "donated"),
        ("lost", "lost"), ("recomputed_tokens", "recomputed"),
        ("ttft_restore_ms", "ttft restore ms"), ("ttft_recompute_ms", "ttft recompute ms"),
        ("speedup", "recompute/restore"), ("max_abs_logprob_diff", "max|Δ logprob|"),
        ("draft_max_abs_logprob_diff", "draft max|Δ|"), ("kl", "KL")]))
    restored_turns = [t for t in turns if t["restored_tokens"] > 0]
    ratio = None
    if restored_turns:
        ratio = (sum(t["ttft_recompute_s"] for t in restored_turns)
                 / sum(t["ttft_restore_s"] for t in restored_turns))
    out("")
    out("offloads settled before every lookup (the demo waits for them: "
        f"{sum(t['settle_wait_s'] for t in turns) * 1e3:.1f} ms in all); 'in store' is what the "
        "store's probe found at the lookup, 'lost' counts the offloads dropped, skipped or "
        "failed and the objects the store evicted since the turn before")
    if not controls:
        out("negative control: the model has no state to corrupt")
    for r in results:
        out(r.line())
    if ratio is not None:
        out(f"time to first token, recompute / restore over the {len(restored_turns)} turns that "
            f"restored: {ratio:.2f}x")
    cpu_ratio = None
    if restored_turns:
        cpu_ratio = (sum(t["cpu_recompute_s"] for t in restored_turns)
                     / sum(t["cpu_restore_s"] for t in restored_turns))
        out(f"CPU seconds, recompute / restore (incl. donating checkpoints) over the same turns: "
            f"{cpu_ratio:.2f}x")
        total = {p: sum(t["restore_phases_s"][p] for t in restored_turns)
                 for p in restored_turns[0]["restore_phases_s"]}
        whole = sum(total.values())
        out("where the restoring turns' time to first token went: " + ", ".join(
            f"{p} {1e3 * v:.1f} ms ({100 * v / whole:.0f}%)" for p, v in total.items()))
    out(f"store hits: {stats.store_hit_tokens} tokens; verify failures {stats.verify_failures}; "
        f"offloads dropped (latency watermark) {stats.offloads_dropped}, skipped (backpressure) "
        f"{stats.offloads_skipped_mamba + stats.offloads_skipped_kv + stats.offloads_skipped_breaker}, "
        f"failed {stats.offload_failures}; store evictions {final_losses['store_evictions']}")
    exact = all(t["max_abs_logprob_diff"] == 0.0 and t["kl"] == 0.0
                and t["draft_max_abs_logprob_diff"] in (None, 0.0) for t in turns)
    restored_ok = all(t["restored_tokens"] == t["expected_restored_tokens"] for t in turns)
    # a checkpoint donated and settled but missing from the store, with no counted loss, is
    # a checkpoint the runtime lost
    accounted = all(t["expected_restored_tokens"] >= t["donated_tokens"]
                    or sum(t["offload_losses_before"].values()) > 0 for t in turns)
    detected = bool(results) and all(r.detected for r in results)
    passed = exact and restored_ok and accounted and detected
    problems = [msg for ok, msg in (
        (exact, "restored logprobs differ from the recompute"),
        (restored_ok, "a turn restored fewer tokens than the store holds"),
        (accounted, "a donated checkpoint is missing from the store and no offload loss was counted"),
        (detected, "a negative control was not run or moved the output less than its margin "
                   f"(max|Δ logprob| >= {MARGIN.max_abs_logprob_diff:g}, KL >= {MARGIN.kl:g})"),
    ) if not ok]
    out("result: " + ("PASS (every restore bit-exact, every control above its margin)" if passed
                      else "FAIL: " + "; ".join(problems)))
    runs = [r for r in results if r.kl is not None]
    return {
        "arch": g.model_type,
        "store": store_name,
        "large": large,
        "turns": [{key: t[key] for key in (
            "prompt_tokens", "restored_tokens", "expected_restored_tokens", "donated_tokens",
            "offload_losses_before", "settle_wait_s", "recomputed_tokens",
            "max_abs_logprob_diff", "draft_max_abs_logprob_diff", "kl", "ttft_restore_s",
            "ttft_recompute_s", "restore_phases_s", "cpu_restore_s", "cpu_recompute_s")}
            for t in turns],
        "negative_controls": [r.as_json() for r in results],
        "negative_control_margin": attrs.asdict(MARGIN),
        # the weakest control (what the margin is checked against)
        "negative_control_kl": min((r.kl for r in runs if r.kl is not None), default=None),
        "negative_control_max_abs_logprob_diff": min(
            (r.max_abs_logprob_diff for r in runs if r.max_abs_logprob_diff is not None), default=None),
        "offload_losses": final_losses,
        "ttft_ratio_recompute_over_restore": ratio,
        "cpu_ratio_recompute_over_restore": cpu_ratio,
        "passed": passed,
    }


#: the linker's counters of offloads that did not reach the store
_LOSSES = ("offloads_dropped", "offloads_skipped_mamba", "offloads_skipped_kv", "offloads_skipped_breaker",
           "offload_failures")


def _offload_losses(linker: Any, store: Any) -> dict[str, int]:
    """What kept a donated checkpoint out of the store: the linker's offload losses, and the
    objects the store evicted (a capacity-bound store may evict a stored checkpoint)."""
    stats = linker.statistics()
    out = {name: int(getattr(stats, name)) for name in _LOSSES}
    out["store_evictions"] = int(store.statistics().evictions)
    return out
