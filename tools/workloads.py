"""Workloads for the stress tool: Mooncake trace replay and a synthetic agentic generator (the
infinite-cache bound on the prefix hit rate and the causal order are in ``tools/prefix_bound.py``).

A request's prompt is kept compact as a run of *segments* ``(segment id, length)``; the
tokens of a segment are a deterministic function of ``(segment id, position in segment)``, so
two prompts that start with the same segments start with the same tokens, and a segment cut
short (the partial last block of a Mooncake request) is a prefix of the whole segment.
``Request.token_ids()`` materializes the ``int32`` array on demand (the conversation trace
holds ~145 M prompt tokens in total, too many to keep around at once).

Token ids lie in ``[1, vocab_size)``: id 0 (often padding) never occurs.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from .arguments import UsageError
from .prefix_bound import bound_hit_rate as bound_hit_rate
from .prefix_bound import bound_hit_tokens as bound_hit_tokens
from .prefix_bound import causal_parents as causal_parents

DEFAULT_VOCAB_SIZE = 32000
MOONCAKE_BLOCK_TOKENS = 512

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_TOKEN_SALT = 0x6879_6C69_6E6B_6572  # "hylinker"


def _splitmix64_int(x: int) -> int:
    """splitmix64 finalizer on a Python int (no numpy scalar overflow warnings)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_position_table: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)


def _positions(length: int) -> npt.NDArray[np.uint32]:
    """A fixed pseudo-random word per position, grown on demand (same words for everyone)."""
    global _position_table
    if len(_position_table) < length:
        size = max(length, 2 * len(_position_table), 4096)
        words = [_splitmix64_int(i ^ _TOKEN_SALT) >> 32 for i in range(len(_position_table), size)]
        _position_table = np.concatenate([_position_table, np.array(words, dtype=np.uint32)])
    return _position_table[:length]


def _check_vocab_size(vocab_size: int) -> None:
    if not 2 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size must lie in [2, 2**31] (token id 0 is never used), got {vocab_size}")


def _segment_mix(segment_id: int) -> np.uint32:
    if segment_id < 0:
        raise ValueError(f"segment id must be >= 0, got {segment_id}")
    return np.uint32(_splitmix64_int(segment_id) >> 32)


def _fill_segments(segments: Sequence[tuple[int, int]], vocab_size: int) -> npt.NDArray[np.int32]:
    total = sum(n for _, n in segments)
    out = np.empty(total, dtype=np.uint32)
    table = _positions(max((n for _, n in segments), default=0))
    start = 0
    for seg_id, n in segments:
        if n < 0:
            raise ValueError(f"segment length must be >= 0, got {n}")
        np.bitwise_xor(table[:n], _segment_mix(seg_id), out=out[start:start + n])
        start += n
    out %= np.uint32(vocab_size - 1)
    out += np.uint32(1)
    return out.view(np.int32)


def segment_tokens(segment_id: int, length: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> npt.NDArray[np.int32]:
    """The first ``length`` tokens of segment ``segment_id``: ids in ``[1, vocab_size)``.

    ``token[pos] = (W[pos] xor s) mod (vocab_size - 1) + 1`` with ``W`` a fixed pseudo-random
    word per position and ``s`` a 32-bit mix of the segment id: cheap enough to materialize
    the whole conversation trace (~145 M tokens) in about a second.
    """
    _check_vocab_size(vocab_size)
    return _fill_segments([(segment_id, length)], vocab_size)


def _segments_converter(value: Iterable[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(s), int(n)) for s, n in value)


@attrs.frozen
class PromptTokens:
    """A prompt as segments ``(segment id, length)``; materializes to an ``int32`` array."""

    segments: tuple[tuple[int, int], ...] = attrs.field(converter=_segments_converter)
    vocab_size: int = attrs.field(default=DEFAULT_VOCAB_SIZE)

    @segments.validator
    def _check_segments(self, _: Any, value: tuple[tuple[int, int], ...]) -> None:
        for seg_id, length in value:
            if seg_id < 0 or length <= 0:
                raise ValueError(f"bad segment ({seg_id}, {length}): id must be >= 0, length > 0")

    @vocab_size.validator
    def _check_vocab(self, _: Any, value: int) -> None:
        _check_vocab_size(value)

    @property
    def length(self) -> int:
        return sum(n for _, n in self.segments)

    def materialize(self) -> npt.NDArray[np.int32]:
        """The prompt's token ids, a fresh ``int32`` array."""
        return _fill_segments(self.segments, self.vocab_size)

    def extended(self, *segments: tuple[int, int]) -> PromptTokens:
        """This prompt followed by ``segments`` (the continuation shares this prefix)."""
        return PromptTokens(self.segments + tuple(segments), self.vocab_size)


@attrs.frozen
class Request:
    """One request of a workload, in arrival order of its source.

    ``arrival_s`` is seconds since the workload's start; ``prompt`` materializes to the prompt
    token ids; ``output_length`` is how many tokens the request decodes; ``session_id`` groups
    the turns (and branches) of one conversation, ``None`` when the source has no sessions.
    """

    request_id: str
    arrival_s: float = attrs.field()
    prompt: PromptTokens = attrs.field()
    output_length: int = attrs.field()
    session_id: str | None = None

    @arrival_s.validator
    def _check_arrival(self, _: Any, value: float) -> None:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"request {self.request_id}: arrival_s must be finite and >= 0, got {value}")

    @output_length.validator
    def _check_output(self, _: Any, value: int) -> None:
        if value < 0:
            raise ValueError(f"request {self.request_id}: output_length must be >= 0, got {value}")

    @property
    def prompt_length(self) -> int:
        return self.prompt.length

    def token_ids(self) -> npt.NDArray[np.int32]:
        """The prompt's token ids (a fresh ``int32`` array)."""
        return self.prompt.materialize()


# ---------------------------------------------------------------------------------------------
# Mooncake trace


class TraceFormatError(UsageError):
    """A trace line is malformed; the message names the file and line number (a ``ValueError``;
    the command line reports it in one line)."""


_TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _int_field(record: dict[str, Any], name: str, where: str) -> int:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TraceFormatError(f"{where}: {name!r} must be an integer, got {value!r}")
    if value < 0:
        raise TraceFormatError(f"{where}: {name!r} must be >= 0, got {value}")
    return value


def parse_mooncake_record(
    record: Any, where: str, *, block_tokens: int
) -> tuple[int, int, int, list[int]]:
    """Validate one decoded trace record; returns (timestamp_ms, input_length, output_length, hash_ids)."""
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [f for f in _TRACE_FIELDS if f not in record]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp = _int_field(record, "timestamp", where)
    input_length = _int_field(record, "input_length", where)
    output_length = _int_field(record, "output_length", where)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    if any(h < 0 for h in hash_ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be >= 0, got {min(hash_ids)}")
    if input_length == 0:
        raise TraceFormatError(f"{where}: 'input_length' must be > 0 (a request forwards at least one token)")
    n = len(hash_ids)
    if not block_tokens * (n - 1) < input_length <= block_tokens * n:
        raise TraceFormatError(
            f"{where}: input_length {input_length} is inconsistent with {n} hash_ids of "
            f"{block_tokens} tokens (needs {block_tokens * (n - 1) + 1 if n else 1}.."
            f"{block_tokens * n} tokens)")
    return timestamp, input_length, output_length, hash_ids


def read_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    first_n: int | None = None,
    time_scale: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """Read a Mooncake FAST'25 trace (JSONL ``{"timestamp", "input_length", "output_length",
    "hash_ids"}``, timestamps in milliseconds).

    Each hash id names a ``block_tokens``-token block whose tokens depend on the hash id alone
    (the trace's hash ids are already prefix-chained); the last block is cut to
    ``input_length``. ``arrival_s = timestamp / 1000 * time_scale`` (``time_scale=0.1`` replays
    ten times faster; 0 makes every request arrive at once). ``first_n`` keeps only the first
    ``n`` requests. A path ending in ``.gz`` is read through gzip. Blank lines are skipped; a malformed line raises :class:`TraceFormatError`
    naming its line number. Request ids are ``mc-{index}`` in file order.
    """
    if first_n is not None and first_n < 0:
        raise ValueError(f"first_n must be >= 0 or None, got {first_n}")
    if not (math.isfinite(time_scale) and time_scale >= 0):
        raise ValueError(f"time_scale must be finite and >= 0, got {time_scale}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    requests: list[Request] = []
    if first_n == 0:
        return requests
    opener: Any = gzip.open if os.fspath(path).endswith(".gz") else open  # the shipped copy is gzipped
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: bad JSON: {exc.msg} (column {exc.colno})") from None
            timestamp, input_length, output_length, hash_ids = parse_mooncake_record(
                record, where, block_tokens=block_tokens)
            last = input_length - block_tokens * (len(hash_ids) - 1)
            segments = [(h, block_tokens) for h in hash_ids[:-1]]
            segments.append((hash_ids[-1], last))
            requests.append(Request(
                request_id=f"mc-{len(requests)}",
                arrival_s=timestamp / 1000.0 * time_scale,
                prompt=PromptTokens(segments, vocab_size),
                output_length=output_length,
            ))
            if first_n is not None and len(requests) >= first_n:
                break
    return requests


# ---------------------------------------------------------------------------------------------
# Synthetic agentic workload


def _check_range(name: str, value: tuple[int, int]) -> None:
    lo, hi = value
    if lo <= 0 or hi < lo:
        raise ValueError(f"{name} must be (lo, hi) with 0 < lo <= hi, got {value}")


def synthetic_agentic(
    n_requests: int,
    *,
    seed: int,
    n_system_prompts: int = 3,
    system_prompt_tokens: tuple[int, int] = (1024, 4096),
    user_tokens: tuple[int, int] = (32, 512),
    output_tokens: tuple[int, int] = (32, 512),
    tool_result_tokens: tuple[int, int] = (64, 1024),
    mean_turns: float = 6.0,
    branch_probability: float = 0.15,
    max_branches: int = 4,
    long_context_probability: float = 0.1,
    long_context_tokens: tuple[int, int] = (16384, 65536),
    max_prompt_tokens: int = 131072,
    session_rate: float = 2.0,
    mean_think_s: float = 5.0,
    scale: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """A deterministic agentic workload, sorted by arrival, with exactly ``n_requests`` requests.

    Sessions arrive as a Poisson process (``session_rate`` per second). Each starts from one of
    ``n_system_prompts`` shared system prompts, sometimes (``long_context_probability``) with a
    long document after it, then a user message. Every next turn is the previous prompt + the
    previous output + new text (a user message, or a tool result when the session forks).
    With ``branch_probability`` a turn forks into two continuations (parallel tool calls) that
    share everything up to and including the output that issued them (at most
    ``max_branches`` branches per session, so the fork process stays finite). Turns of one branch
    follow each other after an exponential think time (mean ``mean_think_s``); a branch ends
    after a geometric number of turns (mean ``mean_turns``) or when its prompt would exceed
    ``max_prompt_tokens``. ``scale`` multiplies every token size, so ``scale=0.05`` makes a
    small run. Request ids are ``ag-s{session}.b{branch}.t{turn}``; session ids ``ag-s{session}``.
    """
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    if n_system_prompts <= 0:
        raise ValueError(f"n_system_prompts must be > 0, got {n_system_prompts}")
    for name, rng_range in (("system_prompt_tokens", system_prompt_tokens),
                            ("user_tokens", user_tokens), ("output_tokens", output_tokens),
                            ("tool_result_tokens", tool_result_tokens),
                            ("long_context_tokens", long_context_tokens)):
        _check_range(name, rng_range)
    for name, p in (("branch_probability", branch_probability),
                    ("long_context_probability", long_context_probability)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {p}")
    if max_branches < 1:
        raise ValueError(f"max_branches must be >= 1, got {max_branches}")
    if not mean_turns >= 1.0:
        raise ValueError(f"mean_turns must be >= 1, got {mean_turns}")
    if not (session_rate > 0 and math.isfinite(session_rate)):
        raise ValueError(f"session_rate must be finite and > 0, got {session_rate}")
    if not (mean_think_s >= 0 and math.isfinite(mean_think_s)):
        raise ValueError(f"mean_think_s must be finite and >= 0, got {mean_think_s}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be > 0, got {max_prompt_tokens}")

    rng = np.random.default_rng(seed)
    next_segment = 0

    def new_segment(size: tuple[int, int]) -> tuple[int, int]:
        nonlocal next_segment
        lo = max(1, round(size[0] * scale))
        hi = max(lo, round(size[1] * scale))
        seg = (next_segment, int(rng.integers(lo, hi + 1)))
        next_segment += 1
        return seg

    system_prompts = [new_segment(system_prompt_tokens) for _ in range(n_system_prompts)]
    # Zipf-like popularity: the first system prompt is the most shared.
    weights = 1.0 / np.arange(1, n_system_prompts + 1)
    weights /= weights.sum()
    p_end = 1.0 / mean_turns

    requests: list[Request] = []
    if n_requests == 0:
        return requests
    session = 0
    session_start = 0.0
    # Generate whole sessions, then keep the earliest n_requests. Sessions start in order, so
    # once a session would start after the n-th earliest arrival, no later one can contribute.
    while True:
        session_start += float(rng.exponential(1.0 / session_rate))
        if len(requests) >= n_requests:
            arrivals = np.fromiter((r.arrival_s for r in requests), dtype=np.float64)
            if session_start > np.partition(arrivals, n_requests - 1)[n_requests - 1]:
                break
        sid = f"ag-s{session}"
        head = [system_prompts[int(rng.choice(n_system_prompts, p=weights))]]
        if rng.random() < long_context_probability:
            head.append(new_segment(long_context_tokens))
        head.append(new_segment(user_tokens))
        # branches: (branch index, prompt, arrival, turn)
        pending: list[tuple[int, PromptTokens, float, int]] = [
            (0, PromptTokens(head, vocab_size), session_start, 0)]
        n_branches = 1
        while pending:
            branch, prompt, arrival, turn = pending.pop(0)
            while True:
                out = new_segment(output_tokens)
                requests.append(Request(
                    request_id=f"{sid}.b{branch}.t{turn}", arrival_s=arrival, prompt=prompt,
                    output_length=out[1], session_id=sid))
                if rng.random() < p_end:
                    break
                after = prompt.extended(out)
                arrival += float(rng.exponential(mean_think_s)) if mean_think_s > 0 else 0.0
                if rng.random() < branch_probability and n_branches < max_branches:
                    # Two parallel tool calls: both continue from the same prefix.
                    fork = after.extended(new_segment(tool_result_tokens))
                    if fork.length <= max_prompt_tokens:
                        pending.append((n_branches, fork, arrival, turn + 1))
                        n_branches += 1
                    prompt = after.extended(new_segment(tool_result_tokens))
                else:
                    prompt = after.extended(new_segment(user_tokens))
                if prompt.length > max_prompt_tokens:
                    break
                turn += 1
        session += 1
    requests.sort(key=lambda r: r.arrival_s)  # stable: a session's order is kept on ties
    return requests[:n_requests]
