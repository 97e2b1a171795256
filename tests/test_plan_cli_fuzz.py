"""Fuzzing `afore plan`'s input files (hypothesis): any demand and state document, JSON or
NPZ, either plans a target whose JSON verifies (plan_verify) or is refused with exit code 2 and
a message naming a field; nothing else (no traceback, no plan that does not verify)."""

from __future__ import annotations

import io
import json
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from afore.cli import main
from afore.scheduler.plan_verify import verify_plan_json

E, F, R = 8, 2, 2
GOOD_STATE = {
    "shape": {"num_experts": E, "num_workers": F, "redundant_slots": R, "m_tile": 4},
    "slot_table": {"expert": [[5, -1], [-1, -1]], "last_used": [[3, -1], [-1, -1]]},
    "protected": [[True, False], [False, False]],
    "prev_assignment": None,
    "params": {"theta": 0, "copy_budget": 4},
    "target": {"step": 1, "layer": 0, "microbatch": 0},
    "seq": 7,
}
GOOD_DEMAND = {"demand": [40, 4, 4, 4, 4, 4, 4, 4]}
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=20)


def _mutate(doc: dict, key_path: list[str], value) -> dict:
    """``doc`` with the value at ``key_path`` (existing keys, or one new key) replaced by ``value``."""
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in key_path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[key_path[-1]] = value
    return doc


def _run(demand_bytes: bytes, state_bytes: bytes, suffix: str = ".json") -> tuple[int, str, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="afore-plan-fuzz-"))
    (tmp / f"d{suffix}").write_bytes(demand_bytes)
    (tmp / f"s{suffix}").write_bytes(state_bytes)
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        rc = main(["plan", "--demand", str(tmp / f"d{suffix}"), "--state", str(tmp / f"s{suffix}"),
                   "--out", str(tmp / "plan.json")])
    return rc, err.getvalue(), tmp / "plan.json"


def _check(rc: int, err: str, out: Path) -> None:
    assert rc in (0, 2), f"exit {rc}: {err}"
    if rc == 0:
        assert verify_plan_json(json.loads(out.read_text())) == []
    else:
        assert err.startswith("afore plan: ") and ": " in err[len("afore plan: "):], err
        assert "Traceback" not in err and not out.exists()


STATE_PATHS = st.sampled_from([["shape"], ["shape", "num_experts"], ["shape", "num_workers"], ["shape", "redundant_slots"],
                               ["shape", "m_tile"], ["slot_table"], ["slot_table", "expert"], ["slot_table", "last_used"],
                               ["protected"], ["prev_assignment"], ["params"], ["params", "theta"],
                               ["params", "copy_budget"], ["params", "chains"], ["cost"], ["cost", "window_ms"],
                               ["cost", "beta_tile_ms"], ["target"], ["target", "layer"], ["target", "step"], ["seq"],
                               ["unknown_key"]])


@FUZZ
@given(path=STATE_PATHS, value=json_values)
def test_a_state_with_one_field_replaced_plans_or_names_the_field(path, value):
    rc, err, out = _run(json.dumps(GOOD_DEMAND).encode(), json.dumps(_mutate(GOOD_STATE, path, value)).encode())
    _check(rc, err, out)


@FUZZ
@given(demand=json_values)
def test_any_demand_document_plans_or_names_the_field(demand):
    rc, err, out = _run(json.dumps(demand).encode(), json.dumps(GOOD_STATE).encode())
    _check(rc, err, out)


@FUZZ
@given(demand=st.lists(st.integers(-10, 10**6), min_size=0, max_size=12))
def test_demand_vectors_of_any_length_and_sign(demand):
    rc, err, out = _run(json.dumps({"demand": demand}).encode(), json.dumps(GOOD_STATE).encode())
    _check(rc, err, out)
    assert (rc == 0) == (len(demand) == E and min(demand) >= 0)


@FUZZ
@given(data=st.binary(max_size=300), which=st.sampled_from(["demand", "state"]), suffix=st.sampled_from([".json", ".npz"]))
def test_arbitrary_bytes_as_either_file(data, which, suffix):
    good = {"demand": _npz(demand=np.array(GOOD_DEMAND["demand"])) if suffix == ".npz" else json.dumps(GOOD_DEMAND).encode(),
            "state": _npz(num_experts=E, num_workers=F, redundant_slots=R, m_tile=4) if suffix == ".npz"
            else json.dumps(GOOD_STATE).encode()}
    good[which] = data
    rc, err, out = _run(good["demand"], good["state"], suffix)
    _check(rc, err, out)


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@FUZZ
@given(key=st.sampled_from(["slot_expert", "slot_last_used", "protected", "prev_assignment", "theta", "copy_budget",
                            "window_ms", "step", "layer", "seq", "num_experts", "m_tile"]),
       value=st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                       st.lists(st.integers(-5, 20), max_size=10).map(np.array),
                       st.lists(st.lists(st.integers(-5, 20), min_size=2, max_size=2), max_size=4).map(np.array)))
def test_npz_state_with_one_array_replaced(key, value):
    arrays = dict(num_experts=E, num_workers=F, redundant_slots=R, m_tile=4)
    arrays[key] = value
    rc, err, out = _run(_npz(demand=np.array(GOOD_DEMAND["demand"])), _npz(**arrays), ".npz")
    _check(rc, err, out)
