"""The one way a benchmark writes its JSON: the folder made if missing, one object, one-space
indents (figures files are read by people as well as by scripts), a final newline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | str, record: Any) -> Path:
    """Write ``record`` to ``path`` as JSON (parent folders made); returns the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


__all__ = ["write_json"]
