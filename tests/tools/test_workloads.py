"""Workloads: Mooncake trace parsing, deterministic tokens, the agentic generator, and the
infinite-cache bound on the prefix hit rate."""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from hylinker.components.mamba import restorable_ceiling
from hylinker.tools.traces import mooncake_trace
from hylinker.tools.workloads import (
    PromptTokens,
    Request,
    TraceFormatError,
    bound_hit_rate,
    bound_hit_tokens,
    read_mooncake_trace,
    segment_tokens,
    synthetic_agentic,
)

TRACE = mooncake_trace()  # beside the repository, or the bundled copy (tools/traces.py)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _line(ts: int = 0, inp: int = 600, out: int = 10, ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out,
                       "hash_ids": [0, 1] if ids is None else ids})


# ---------------------------------------------------------------------------------------------
# trace parsing


def test_read_trace_fields_and_time_scale(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        _line(0, 600, 10, [0, 1]),
        "",  # blank lines are skipped
        _line(1500, 1024, 7, [0, 2]),
        _line(3000, 5, 0, [3]),
    ])
    reqs = read_mooncake_trace(path, time_scale=0.5)
    assert [r.request_id for r in reqs] == ["mc-0", "mc-1", "mc-2"]
    assert [r.arrival_s for r in reqs] == [0.0, 0.75, 1.5]
    assert [r.prompt_length for r in reqs] == [600, 1024, 5]
    assert [len(r.token_ids()) for r in reqs] == [600, 1024, 5]
    assert [r.output_length for r in reqs] == [10, 7, 0]
    assert all(r.session_id is None for r in reqs)
    assert reqs[0].prompt.segments == ((0, 512), (1, 88))

    first = read_mooncake_trace(path, first_n=2, time_scale=1.0)
    assert [r.arrival_s for r in first] == [0.0, 1.5]
    assert read_mooncake_trace(path, first_n=0) == []
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(Path(path).read_bytes()))
    assert read_mooncake_trace(packed, time_scale=0.5) == reqs


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "bad JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": [0, 1]}), "output_length"),
        (json.dumps({"input_length": 600, "output_length": 1, "hash_ids": [0, 1]}), "timestamp"),
        (_line(-5), "'timestamp' must be >= 0"),
        (_line(0, 600, -1), "'output_length' must be >= 0"),
        (_line(0, -600), "'input_length' must be >= 0"),
        (_line(0, 600, 10, [0, -1]), "'hash_ids' must be >= 0"),
        (_line(0, 0, 10, []), "'input_length' must be > 0"),
        (_line(0, 1025, 10, [0, 1]), "inconsistent with 2 hash_ids"),  # one block short
        (_line(0, 512, 10, [0, 1]), "inconsistent with 2 hash_ids"),  # one block too many
        (json.dumps({"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": "ab"}),
         "list of integers"),
        (json.dumps({"timestamp": "0", "input_length": 6, "output_length": 1, "hash_ids": [1]}),
         "'timestamp' must be an integer"),
        (json.dumps({"timestamp": 0.5, "input_length": 6, "output_length": 1, "hash_ids": [1]}),
         "'timestamp' must be an integer"),
    ],
)
def test_malformed_line_names_line_number(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [_line(), _line(10), bad, _line(20)])
    with pytest.raises(TraceFormatError, match=message) as info:
        read_mooncake_trace(path)
    assert f"{path}:3:" in str(info.value)
    # the lines before it are fine on their own
    assert len(read_mooncake_trace(path, first_n=2)) == 2


def test_read_trace_bad_arguments(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line()])
    with pytest.raises(ValueError, match="time_scale"):
        read_mooncake_trace(path, time_scale=-1.0)
    with pytest.raises(ValueError, match="first_n"):
        read_mooncake_trace(path, first_n=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        read_mooncake_trace(path, block_tokens=0)


# ---------------------------------------------------------------------------------------------
# tokens


def test_tokens_deterministic_and_prefix_shared(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(0, 1536, 1, [5, 6, 7]), _line(0, 1536, 1, [5, 6, 8]),
                             _line(0, 1024, 1, [9, 6])])
    a, b, c = read_mooncake_trace(path)
    ta, tb, tc = a.token_ids(), b.token_ids(), c.token_ids()
    assert ta.dtype == np.int32
    np.testing.assert_array_equal(ta, a.token_ids())  # deterministic
    np.testing.assert_array_equal(ta[:1024], tb[:1024])  # shared prefix blocks
    assert (ta[1024:] != tb[1024:]).mean() > 0.99  # different last block
    # a block's tokens depend on its hash id alone
    np.testing.assert_array_equal(tc[512:], ta[512:1024])
    assert (tc[:512] != ta[:512]).mean() > 0.99
    # fresh reads give the same tokens
    np.testing.assert_array_equal(read_mooncake_trace(path)[0].token_ids(), ta)


def test_partial_last_block(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(0, 1000, 1, [3, 4]), _line(0, 1024, 1, [3, 4]),
                             _line(0, 513, 1, [3, 4])])
    short, full, one = (r.token_ids() for r in read_mooncake_trace(path))
    assert len(short) == 1000 and len(full) == 1024 and len(one) == 513
    np.testing.assert_array_equal(short, full[:1000])
    np.testing.assert_array_equal(one, full[:513])
    np.testing.assert_array_equal(short[512:], segment_tokens(4, 488))


def test_token_range_and_vocab() -> None:
    toks = segment_tokens(123, 100_000)
    assert toks.min() >= 1 and toks.max() < 32000
    assert len(np.unique(toks)) > 30000  # spread over the vocabulary
    tiny = PromptTokens([(1, 1000), (2, 1000)], vocab_size=3).materialize()
    assert set(np.unique(tiny).tolist()) == {1, 2}
    np.testing.assert_array_equal(segment_tokens(7, 50), segment_tokens(7, 200)[:50])
    with pytest.raises(ValueError, match="vocab_size"):
        PromptTokens([(1, 4)], vocab_size=1)
    with pytest.raises(ValueError, match="bad segment"):
        PromptTokens([(1, 0)])


# ---------------------------------------------------------------------------------------------
# synthetic agentic generator


def _small(seed: int, n: int = 150) -> list[Request]:
    return synthetic_agentic(n, seed=seed, scale=0.05, branch_probability=0.3,
                             long_context_probability=0.2)


def test_generator_deterministic() -> None:
    a, b = _small(3), _small(3)
    assert a == b
    assert [r.token_ids().tolist() for r in a[:10]] == [r.token_ids().tolist() for r in b[:10]]
    assert _small(4) != a
    assert synthetic_agentic(0, seed=1) == []


def test_generator_shape() -> None:
    reqs = _small(5)
    assert len(reqs) == 150
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in reqs}) == len(reqs)

    # a few shared system prompts open the sessions
    first_segments: dict[int, set[str | None]] = defaultdict(set)
    for r in reqs:
        first_segments[r.prompt.segments[0][0]].add(r.session_id)
    assert len(first_segments) <= 3
    assert max(len(s) for s in first_segments.values()) > 1

    by_id = {r.request_id: r for r in reqs}
    grown = branched = 0
    for r in reqs:
        sid, branch, turn = r.request_id.rsplit(".", 2)
        t = int(turn[1:])
        prev = by_id.get(f"{sid}.{branch}.t{t - 1}")
        if prev is not None:
            # next turn = previous prompt + previous output + new text
            segs = r.prompt.segments
            assert segs[: len(prev.prompt.segments)] == prev.prompt.segments
            assert segs[len(prev.prompt.segments)][1] == prev.output_length
            assert len(segs) == len(prev.prompt.segments) + 2
            assert r.prompt_length > prev.prompt_length
            grown += 1
        if branch != "b0":
            branched += 1
    assert grown > 20
    assert branched > 0

    # a fork: two requests of one session with the same prefix and different continuations
    forks = 0
    by_session: dict[str | None, list[Request]] = defaultdict(list)
    for r in reqs:
        by_session[r.session_id].append(r)
    for group in by_session.values():
        for i, x in enumerate(group):
            for y in group[i + 1:]:
                n = min(len(x.prompt.segments), len(y.prompt.segments))
                if (n >= 2 and x.prompt.segments[: n - 1] == y.prompt.segments[: n - 1]
                        and x.prompt.segments[n - 1] != y.prompt.segments[n - 1]
                        and len(x.prompt.segments) == len(y.prompt.segments)):
                    forks += 1
    assert forks > 0
    # long contexts exist (16384 * 0.05 tokens at least, on top of the system prompt)
    assert max(r.prompt_length for r in reqs) > 16384 * 0.05 + 4096 * 0.05


def test_generator_bad_arguments() -> None:
    with pytest.raises(ValueError, match="branch_probability"):
        synthetic_agentic(10, seed=0, branch_probability=1.5)
    with pytest.raises(ValueError, match="user_tokens"):
        synthetic_agentic(10, seed=0, user_tokens=(10, 5))
    with pytest.raises(ValueError, match="n_requests"):
        synthetic_agentic(-1, seed=0)


# ---------------------------------------------------------------------------------------------
# infinite-cache bound


def _req(rid: str, t: float, segments: list[tuple[int, int]]) -> Request:
    return Request(request_id=rid, arrival_s=t, prompt=PromptTokens(segments), output_length=1)


def test_bound_hand_made() -> None:
    # page 4 tokens, grid 2 pages (8 tokens). A: 14 tokens; B shares A's first 12 tokens
    # (3 whole pages), then differs, 20 tokens in all.
    a = _req("a", 0.0, [(1, 12), (2, 2)])
    b = _req("b", 1.0, [(1, 12), (3, 8)])
    # B: ceiling floor(19/8)*8 = 16; common prefix 3 pages = 12 -> grid floor 8.
    assert bound_hit_tokens([a, b], page_size=4, grid=8) == (8, 34)
    # non-hybrid (grid = page): 3 pages = 12 tokens, under the ceiling floor(19/4)*4 = 16
    assert bound_hit_tokens([a, b], page_size=4, grid=4) == (12, 34)
    # a partial page of the earlier prompt is not held: page 8 -> A has 1 whole page (8)
    assert bound_hit_tokens([a, b], page_size=8, grid=8) == (8, 34)
    assert bound_hit_rate([a, b], page_size=4, grid=8) == pytest.approx(8 / 34)
    # arrival order decides who reuses whom: listed backwards, the result is the same;
    # B arriving first makes A the reuser (A: ceiling floor(13/4)*4 = 12, common 12).
    assert bound_hit_tokens([b, a], page_size=4, grid=8) == (8, 34)
    b_first = _req("b", 0.0, [(1, 12), (3, 8)])
    a_late = _req("a", 1.0, [(1, 12), (2, 2)])
    assert bound_hit_tokens([a_late, b_first], page_size=4, grid=4) == (12, 34)
    assert bound_hit_tokens([a_late, b_first], page_size=4, grid=8) == (8, 34)


def test_bound_l_minus_1_ceiling() -> None:
    # an identical prompt still recomputes at least one token
    a = _req("a", 0.0, [(1, 16)])
    again = _req("a2", 1.0, [(1, 16)])
    hit, total = bound_hit_tokens([a, again], page_size=4, grid=4)
    assert (hit, total) == (12, 32)  # floor(15/4)*4
    assert bound_hit_tokens([a, again], page_size=4, grid=8)[0] == 8  # floor(15/8)*8
    one = _req("one", 0.0, [(1, 1)])
    assert bound_hit_tokens([one, one], page_size=1, grid=1) == (0, 2)
    # one token more than the earlier prompt: the whole earlier prompt is reusable
    longer = _req("b", 1.0, [(1, 16), (9, 1)])
    assert bound_hit_tokens([a, longer], page_size=4, grid=8)[0] == 16


def test_bound_bad_arguments() -> None:
    a = _req("a", 0.0, [(1, 16)])
    with pytest.raises(ValueError, match="grid"):
        bound_hit_tokens([a], page_size=4, grid=6)
    with pytest.raises(ValueError, match="page_size"):
        bound_hit_tokens([a], page_size=0, grid=4)
    assert bound_hit_tokens([], page_size=4, grid=4) == (0, 0)
    assert bound_hit_rate([], page_size=4, grid=4) == 0.0


def _brute_force_bound(reqs: list[Request], page: int, grid: int) -> int:
    order = sorted(reqs, key=lambda r: r.arrival_s)
    toks = [r.token_ids() for r in order]
    hit = 0
    for i, t in enumerate(toks):
        best = 0
        for prev in toks[:i]:
            n = min(len(prev) // page * page, len(t))
            diff = np.flatnonzero(prev[:n] != t[:n])
            common = int(diff[0]) if diff.size else n
            best = max(best, common // page * page)
        hit += min(restorable_ceiling(len(t), grid), best // grid * grid)
    return hit


@pytest.mark.parametrize(("page", "grid"), [(16, 16), (16, 64), (64, 64), (8, 24)])
def test_bound_matches_brute_force(page: int, grid: int) -> None:
    reqs = _small(11, n=80)
    hit, total = bound_hit_tokens(reqs, page_size=page, grid=grid)
    assert total == sum(r.prompt_length for r in reqs)
    assert hit == _brute_force_bound(reqs, page, grid)
    assert 0 < hit < total


def test_full_trace_bound() -> None:
    start = time.monotonic()
    reqs = read_mooncake_trace(TRACE, time_scale=1.0)
    assert len(reqs) == 12031
    assert reqs[-1].arrival_s == pytest.approx(3537.0, abs=1.0)
    hit, total = bound_hit_tokens(reqs, page_size=512, grid=512)
    rate = hit / total
    print(f"conversation trace bound page=512: {hit}/{total} = {rate:.4f} "
          f"({time.monotonic() - start:.1f} s)")
    assert total == 144_793_823
    assert 0.36 < rate < 0.38  # the published ~37%


@pytest.mark.slow
def test_full_trace_bound_fine_pages() -> None:
    reqs = read_mooncake_trace(TRACE, time_scale=1.0)
    rate_64 = bound_hit_rate(reqs, page_size=64, grid=64)
    rate_hybrid = bound_hit_rate(reqs, page_size=64, grid=512)
    print(f"conversation trace bound page=64 grid=64: {rate_64:.4f}; grid=512: {rate_hybrid:.4f}")
    assert 0.36 < rate_hybrid <= rate_64 < 0.38


def test_the_bundled_trace_is_found_without_a_shared_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean clone with nothing beside it gets the bundled copy, unpacked once, whole; the
    environment variable still wins."""
    from hylinker.tools import traces

    monkeypatch.delenv("HYLINKER_MOONCAKE_TRACE", raising=False)
    monkeypatch.setattr(traces, "BESIDE_REPOSITORY", tmp_path / "absent.jsonl")
    monkeypatch.setattr(traces.tempfile, "tempdir", str(tmp_path))
    path = traces.mooncake_trace()
    assert path.parent.parent == tmp_path and path.exists()
    requests = read_mooncake_trace(path)
    assert len(requests) == 12_031
    assert traces.mooncake_trace() == path  # unpacked once, then reused
    monkeypatch.setenv("HYLINKER_MOONCAKE_TRACE", str(tmp_path / "mine.jsonl"))
    assert traces.mooncake_trace() == tmp_path / "mine.jsonl"
