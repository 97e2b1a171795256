"""Where the team's routing traces are: ``../shared/traces/<name>`` beside the repository (or the
working directory), ``$AFORE_TRACES/<name>`` first when set, and the development and CI machines'
``/work/shared/traces/<name>`` last (a clone elsewhere, e.g. under /tmp, still finds them)."""

from __future__ import annotations

import os
from pathlib import Path

SHARED_TRACES = Path("/work/shared/traces")


def trace_dir_candidates(name: str) -> list[Path]:
    """The folders to look for trace set ``name`` in, in order."""
    candidates = [Path(os.environ["AFORE_TRACES"]) / name] if os.environ.get("AFORE_TRACES") else []
    repo = Path(__file__).resolve().parents[2]
    return candidates + [repo.parent / "shared" / "traces" / name, Path.cwd().parent / "shared" / "traces" / name,
                         SHARED_TRACES / name]
