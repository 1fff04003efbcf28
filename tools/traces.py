"""Where the Mooncake FAST'25 conversation trace is found (stress replays, studies, tests).

The trace is public data (kvcache-ai/Mooncake, the FAST'25 release, Apache-2.0: 12,031 requests
over one hour, ``hash_ids`` are 512-token prefix blocks). The project ships a gzipped copy so a
clean clone replays it with nothing next to it; the lookup order is

1. ``HYLINKER_MOONCAKE_TRACE``, a path, when set;
2. ``../shared/traces/mooncake_conversation_trace.jsonl`` beside the repository, when present;
3. the bundled copy, unpacked once into the temporary directory.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path

NAME = "mooncake_conversation_trace.jsonl"
BUNDLED = Path(__file__).with_name("data") / f"{NAME}.gz"
BESIDE_REPOSITORY = Path(__file__).resolve().parents[2] / "shared" / "traces" / NAME


def mooncake_trace() -> Path:
    """The trace's path, by the module's lookup order; a bundled copy missing is an error."""
    env = os.environ.get("HYLINKER_MOONCAKE_TRACE")
    if env:
        return Path(env)
    if BESIDE_REPOSITORY.exists():
        return BESIDE_REPOSITORY
    if not BUNDLED.exists():
        raise FileNotFoundError(f"no Mooncake trace: {BESIDE_REPOSITORY} is absent and so is {BUNDLED}")
    out = Path(tempfile.gettempdir()) / "hylinker-traces" / NAME
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{NAME}.")
        try:
            with gzip.open(BUNDLED, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, out)  # atomic: concurrent test processes never read half a file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return out
