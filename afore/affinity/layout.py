"""Primary layouts from files: what ``afore serve --primaries affinity --primaries-file PATH`` reads.

PATH is either the JSON that ``afore profile affinity --workers F --layout-out PATH`` writes
({"primaries": [owner of each expert], "num_workers": F, "num_experts": E, ...}) or an affinity
profile (.npz), which is co-clustered here into F sets (all profiled layers pooled, the default
load slack). Either way the result is validated against the model's E and the pool's F.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from afore.affinity.cocluster import co_cluster
from afore.affinity.profile import load_profile
from afore.config import check_primary_layout


def load_primary_layout(path: str | Path, num_experts: int, num_workers: int, load_slack: float = 0.1) -> tuple[int, ...]:
    """The primary layout (owner worker of each expert) in ``path``, checked for E and F.

    Raises ValueError naming ``primaries_file`` (unreadable or mismatched file) or ``primaries``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"primaries_file: expected an existing layout (.json) or affinity profile (.npz), got {str(path)!r}")
    if path.suffix == ".npz":
        profile = load_profile(path)
        if profile.num_experts != num_experts:
            raise ValueError(f"primaries_file: the profile has {profile.num_experts} experts, the model {num_experts}")
        owner = co_cluster(*profile.pooled(), num_workers, load_slack)
    else:
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"primaries_file: expected JSON in {str(path)!r}, got: {exc}") from None
        if not isinstance(data, dict) or "primaries" not in data:
            raise ValueError(f"primaries_file: expected an object with a 'primaries' list in {str(path)!r}")
        if data.get("num_workers", num_workers) != num_workers:
            raise ValueError(f"primaries_file: the layout is for {data['num_workers']} FFN workers, the pool has {num_workers}")
        owner = np.asarray(data["primaries"])
    return tuple(int(w) for w in check_primary_layout(owner, num_experts, num_workers))
