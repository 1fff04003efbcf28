"""The vLLM serve demo: vLLM's OpenAI server on a tiny hybrid model, with and without hylinker.

Run it in the vLLM environment (``bash .ci/vllm-setup.sh`` builds ``.venv-vllm``)::

    .venv-vllm/bin/python -m hylinker serve-demo      # or: just serve-demo

It builds a tiny random-weight qwen3_next, starts a Mooncake master and a storage process on
loopback, then the OpenAI server with ``HylinkerConnector`` (``segment_mb: 0``: the server keeps
no store memory of its own). A multi-turn conversation is sent turn by turn; then vLLM's prefix
cache is reset (as if the server had restarted or evicted it) and the conversation is replayed:
every turn's prefix comes back from the store. Last, a server without the connector (and without
prefix caching) replays it for comparison. For each turn it prints the prompt tokens, the tokens
served from a cache and the time to first token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..stores.mooncake_master import MooncakeMaster
from .harness.tiny_qwen3_next import build_tiny_qwen3_next, corpus
from .harness.vllm_server import free_port, post, start_server, stop_server, time_to_first_token


def turns(n: int, words: int) -> list[list[dict[str, str]]]:
    """The conversation after each of ``n`` user turns (each turn adds ~``words`` tokens)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "you answer with the state of the cache"}]
    out = []
    for i in range(n):
        messages = [*messages, {"role": "user", "content": " ".join(corpus(max(1, words // 10), seed=100 + i))}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": "the cache holds the prefix"}]
    return out


def replay(port: int, convo: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    rows = []
    for i, messages in enumerate(convo):
        ttft, cached = time_to_first_token(port, messages)
        rows.append({"turn": i + 1, "ttft_s": round(ttft, 3), "cached_tokens": cached})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hylinker serve-demo", description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--words", type=int, default=1200, help="tokens each user turn adds (about)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    convo = turns(args.turns, args.words)
    rows: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="hylinker-serve-demo-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        model = build_tiny_qwen3_next(work / "model")
        master = stack.enter_context(MooncakeMaster().start())
        seg = subprocess.Popen([sys.executable, "-m", "hylinker", "mooncake", "segment", "--master",
                                master.address, "--segment-mib", "512"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(seg.kill)
        time.sleep(3)
        extra = {"store": "mooncake", "master": master.address, "segment_mb": 0}
        port = free_port()
        print(f"serve-demo: OpenAI server with HylinkerConnector on :{port} (log {work / 'with.log'})", flush=True)
        proc = start_server(model, port, work / "with.log", extra=extra)
        try:
            rows["first pass (stores)"] = replay(port, convo)
            time.sleep(1.0)
            post(f"http://127.0.0.1:{port}/reset_prefix_cache")
            rows["after prefix-cache reset (restores)"] = replay(port, convo)
        finally:
            stop_server(proc)
        port = free_port()
        print(f"serve-demo: OpenAI server without the connector on :{port}", flush=True)
        proc = start_server(model, port, work / "without.log", extra=None)
        try:
            rows["without connector (recomputes)"] = replay(port, convo)
        finally:
            stop_server(proc)
    print(f"\n{'pass':40} {'turn':>4} {'cached':>7} {'TTFT s':>7}")
    for name, rs in rows.items():
        for r in rs:
            print(f"{name:40} {r['turn']:>4} {r['cached_tokens']:>7} {r['ttft_s']:>7.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
