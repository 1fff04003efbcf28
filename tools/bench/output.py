"""The one way a benchmark writes its JSON: the folder made if missing, one object, one-space
indents (figures files are read by people as well as by scripts), a final newline."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: draws a benchmark's result (its JSON object) as a PNG at the path
Plot = Callable[[dict[str, Any], Path], None]


def write_json(path: Path | str, record: Any) -> Path:
    """Write ``record`` to ``path`` as JSON (parent folders made); returns the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


def add_output_arguments(ap: argparse.ArgumentParser) -> None:
    """``--json``, ``--plot`` and ``--plot-from``: the flags of a benchmark that draws its result."""
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="PNG of the result (needs matplotlib)")
    ap.add_argument("--plot-from", type=Path, help="only draw --plot from this JSON")


def plot_only(ap: argparse.ArgumentParser, args: argparse.Namespace, plot: Plot) -> bool:
    """With ``--plot-from``, draw ``--plot`` from that JSON and return True (nothing to run)."""
    if not args.plot_from:
        return False
    if not args.plot:
        ap.error("--plot-from needs --plot")
    plot(json.loads(args.plot_from.read_text()), args.plot)
    return True


def write_outputs(args: argparse.Namespace, result: dict[str, Any], plot: Plot, module: str) -> None:
    """Write ``--json`` and draw ``--plot``. An engine's environment may lack matplotlib: then say
    how to draw it later from the JSON with ``module`` (below ``hylinker.tools.bench``)."""
    if args.json:
        write_json(args.json, result)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            print(f"no matplotlib here: python3 -m hylinker.tools.bench.{module} --plot-from {args.json} "
                  f"--plot {args.plot}", file=sys.stderr)


__all__ = ["add_output_arguments", "plot_only", "write_json", "write_outputs"]
