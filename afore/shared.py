"""The workplace's shared folder (routing traces, the LeaderWorkerSet CRD): ``../shared`` beside the
repository or the working directory, and the development and CI machines' ``/work/shared`` last,
so a clone elsewhere (e.g. under /tmp) still finds it."""

from __future__ import annotations

import os
from pathlib import Path

WORKPLACE_SHARED = Path("/work/shared")


def candidates(*parts: str) -> list[Path]:
    """Where ``shared/<parts...>`` may be, in order."""
    repo = Path(__file__).resolve().parents[1]
    return [base.joinpath(*parts) for base in (repo.parent / "shared", Path.cwd().parent / "shared", WORKPLACE_SHARED)]


def find(*parts: str) -> Path | None:
    """The first of ``candidates(*parts)`` that exists, else None."""
    return next((p for p in candidates(*parts) if p.exists()), None)


def trace_dir_candidates(name: str) -> list[Path]:
    """The folders to look for trace set ``name`` in: ``$AFORE_TRACES/<name>`` first when set,
    then ``shared/traces/<name>``."""
    first = [Path(os.environ["AFORE_TRACES"]) / name] if os.environ.get("AFORE_TRACES") else []
    return first + candidates("traces", name)
