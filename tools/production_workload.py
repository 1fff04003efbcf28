"""A workload in the production regime of an agentic deployment (issue 44).

What it imitates: the agentic traces published for Mooncake / Kimi serving (many sessions that
share a few long system prompts and tool preambles; multi-turn sessions whose agent loops
append tool results in quick succession, with user pauses of minutes between episodes;
arrivals spread over hours) and the conversation trace the project ships
(``tools/data/mooncake_conversation_trace.jsonl.gz``: sessions extending their own history).
The regime the published TOUCH result needs follows from its shape:

* the shared heads (system prompt + tool preamble) and an active session's history are hit
  by the device turn after turn, so the device keeps them, and the store sees them only once
  (the first offload; an offload writes only what a path lacks);
* every turn offloads its new tail, so a store smaller than the working set turns over in
  minutes of trace time, and its own LRU ages out the device-hot prefixes;
* a user pause longer than the device's LRU window drops a session's history from the
  device; the next episode then needs it from the store, prefix first.

A request's prompt is ``system prompt + tool preamble + history``; an episode is a burst of
agent turns (each adds the previous output and a tool result), an episode's first turn adds a
user message. Sessions arrive as a Poisson process over ``hours`` of trace time; replay
compresses that (``stress --time-scale``). Deterministic for a seed.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from .arguments import UsageError, nearest
from .workloads import DEFAULT_VOCAB_SIZE, PromptTokens, Request


def _range(lo: int, hi: int) -> tuple[int, int]:
    return (lo, hi)


@attrs.frozen
class ProductionShape:
    """The generator's parameters (token sizes before ``scale``; times in trace seconds)."""

    #: sessions started per trace hour (a Poisson process)
    sessions_per_hour: float = 240.0
    #: the trace's length; sessions start in [0, hours) and run past it
    hours: float = 2.0
    n_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = _range(6144, 12288)
    n_tool_preambles: int = 8
    tool_preamble_tokens: tuple[int, int] = _range(2048, 6144)
    user_tokens: tuple[int, int] = _range(64, 512)
    tool_result_tokens: tuple[int, int] = _range(256, 3072)
    output_tokens: tuple[int, int] = _range(32, 384)
    #: episodes per session (geometric mean) and agent turns per episode (geometric mean)
    mean_episodes: float = 4.0
    mean_turns_per_episode: float = 8.0
    #: seconds between agent turns (exponential) and between episodes (a user's pause)
    mean_agent_think_s: float = 4.0
    mean_user_pause_s: float = 300.0
    max_prompt_tokens: int = 65536
    scale: float = 1.0
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __attrs_post_init__(self) -> None:
        for name in ("sessions_per_hour", "hours", "mean_agent_think_s", "mean_user_pause_s", "scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        for name in ("mean_episodes", "mean_turns_per_episode"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_system_prompts < 1 or self.n_tool_preambles < 1 or self.max_prompt_tokens < 1:
            raise ValueError("n_system_prompts, n_tool_preambles and max_prompt_tokens must be >= 1")
        for name in ("system_prompt_tokens", "tool_preamble_tokens", "user_tokens", "tool_result_tokens",
                     "output_tokens"):
            lo, hi = getattr(self, name)
            if lo <= 0 or hi < lo:
                raise ValueError(f"{name} must be (lo, hi) with 0 < lo <= hi, got {(lo, hi)}")


def production_shape(params: list[str], *, scale: float) -> ProductionShape:
    """A :class:`ProductionShape` from ``FIELD=VALUE`` strings (``--workload-param``); a range
    field takes ``LO:HI``. A bad one is a :class:`~.arguments.UsageError` naming the flag (and
    the nearest field to a misspelled one)."""
    fields = {f.name: f for f in attrs.fields(ProductionShape)}
    values: dict[str, object] = {"scale": scale}
    for item in params:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            hint = nearest(name, fields) if sep else ""
            raise UsageError(f"--workload-param {item!r}: expected FIELD=VALUE{hint}, FIELD one of "
                             f"{', '.join(fields)}")
        default = getattr(ProductionShape(), name)
        try:
            if isinstance(default, tuple):
                lo, hi = text.split(":")
                values[name] = (int(lo), int(hi))
            else:
                values[name] = type(default)(text)
        except ValueError as exc:
            raise UsageError(f"--workload-param {item!r}: {exc}") from None
    try:
        return ProductionShape(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(f"--workload-param: {exc}") from None


def production_agentic(n_requests: int, *, seed: int, shape: ProductionShape | None = None) -> list[Request]:
    """The first ``n_requests`` requests (by arrival) of a production-regime agentic trace.

    Request ids ``pr-s{session}.e{episode}.t{turn}``, session ids ``pr-s{session}``."""
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    p = shape if shape is not None else ProductionShape()
    rng = np.random.default_rng(seed)
    next_segment = 0

    def segment(size: tuple[int, int]) -> tuple[int, int]:
        nonlocal next_segment
        lo = max(1, round(size[0] * p.scale))
        hi = max(lo, round(size[1] * p.scale))
        seg = (next_segment, int(rng.integers(lo, hi + 1)))
        next_segment += 1
        return seg

    def zipf(n: int) -> np.ndarray:
        w = 1.0 / np.arange(1, n + 1)
        return w / w.sum()

    systems = [segment(p.system_prompt_tokens) for _ in range(p.n_system_prompts)]
    tools = [segment(p.tool_preamble_tokens) for _ in range(p.n_tool_preambles)]
    w_sys, w_tools = zipf(p.n_system_prompts), zipf(p.n_tool_preambles)
    rate_s = p.sessions_per_hour / 3600.0
    end_s = p.hours * 3600.0
    requests: list[Request] = []
    t = 0.0
    session = 0
    while n_requests:
        t += float(rng.exponential(1.0 / rate_s))
        if t >= end_s:
            break
        sid = f"pr-s{session}"
        prompt = PromptTokens([systems[int(rng.choice(p.n_system_prompts, p=w_sys))],
                               tools[int(rng.choice(p.n_tool_preambles, p=w_tools))]], p.vocab_size)
        arrival = t
        episodes = int(rng.geometric(1.0 / p.mean_episodes))
        done = False
        for e in range(episodes):
            if e:
                arrival += float(rng.exponential(p.mean_user_pause_s))
            prompt = prompt.extended(segment(p.user_tokens))
            for turn in range(int(rng.geometric(1.0 / p.mean_turns_per_episode))):
                if prompt.length > p.max_prompt_tokens:
                    done = True
                    break
                out = segment(p.output_tokens)
                requests.append(Request(request_id=f"{sid}.e{e}.t{turn}", arrival_s=arrival, prompt=prompt,
                                        output_length=out[1], session_id=sid))
                prompt = prompt.extended(out, segment(p.tool_result_tokens))
                arrival += float(rng.exponential(p.mean_agent_think_s))
            if done:
                break
        session += 1
    requests.sort(key=lambda r: r.arrival_s)  # stable: a session's order is kept on ties
    return requests[:n_requests]


__all__ = ["ProductionShape", "production_agentic", "production_shape"]
