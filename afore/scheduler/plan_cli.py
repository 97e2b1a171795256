"""`afore plan`: plan one target from a demand and a state, and write a self-checking JSON.

  afore plan --demand DEMAND --state STATE [--shape E,F,R,M] [--policy afore] --out plan.json
  afore plan --example DIR     writes DIR/demand.json and DIR/state.json to start from

Input files are JSON or NPZ (by suffix).

DEMAND: JSON ``{"demand": [d_0, ..., d_{E-1}]}`` or a bare list; NPZ with array ``demand`` int[E].

STATE (every key optional except the shape, which may come from ``--shape`` instead):
  JSON:
    shape           {"num_experts", "num_workers", "redundant_slots", "m_tile", ...}  (ClusterShape)
    slot_table      {"expert": int[F][R] (-1 empty), "last_used": int[F][R] (-1 never)}  (default empty)
    protected       bool[F][R] U[t]: slots the running target reads (default none)
    prev_assignment int[E][F] A[t-1] of this layer, or null (default null)
    params          {"theta", "copy_budget", "chains"}  (SchedulerParams; default theta 0, B 8, chains on)
    cost            {"beta_tile_ms", "bytes_per_expert", "link_bandwidth_gbps", "copy_latency_ms", "window_ms"}
    target          {"step", "layer", "microbatch"}; seq int  (default (0, 0, 0), 0)
  NPZ: arrays slot_expert, slot_last_used, protected, prev_assignment and scalars num_experts,
    num_workers, redundant_slots, m_tile, theta, copy_budget, the cost fields, step, layer,
    microbatch, seq.

Output: ``{"format": "afore-plan/1", "inputs": {...every input, cost.copy_ms, budgeted...}, "plan":
Plan.to_json(), "slot_table_after": {...}}`` -- everything ``afore/scheduler/plan_verify.py``
(standard library only) needs to check the plan without afore. Bad input: a message naming the
field, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import numpy as np

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.plan import SlotTable, Target
from afore.scheduler.plan_verify import verify_plan_json
from afore.traces.format import read_npz

SHAPE_KEYS = ("num_experts", "num_workers", "redundant_slots", "m_tile")
COST_KEYS = ("beta_tile_ms", "bytes_per_expert", "link_bandwidth_gbps", "copy_latency_ms", "window_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from afore.scheduler.policies import POLICY_NAMES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "Input files are" + __doc__.split("Input files are", 1)[1].split("Output:", 1)[0].rstrip()
    parser.add_argument("--demand", help="demand file (.json or .npz); required unless --example")
    parser.add_argument("--state", help="state file (.json or .npz): shape, slot table, protected, ...; required unless --example")
    parser.add_argument("--shape", default=None, help="E,F,R,M_tile (overrides the state's shape)")
    parser.add_argument("--policy", default="afore", choices=POLICY_NAMES, help="placement policy (default: afore)")
    parser.add_argument("--out", help="plan JSON to write; required unless --example")
    parser.add_argument("--example", metavar="DIR", default=None,
                        help="write an example DIR/demand.json and DIR/state.json (E=16, F=4, R=2) and print the "
                             "command that plans them; nothing else is read or written")


def write_example(directory: str | Path) -> tuple[Path, Path]:
    """Write an example demand (one hot expert on worker 0) and state (a slot table with two
    bindings, one of them protected) under ``directory``; returns (demand path, state path)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    demand = [64] * 16
    demand[1] = 640  # expert 1, a primary of worker 0: 40 tiles of 16 against 4 on the others
    state = {
        "shape": {"num_experts": 16, "num_workers": 4, "redundant_slots": 2, "m_tile": 16},
        "slot_table": {"expert": [[5, -1], [-1, -1], [0, -1], [-1, -1]],
                       "last_used": [[3, -1], [-1, -1], [3, -1], [-1, -1]]},
        "protected": [[True, False], [False, False], [False, False], [False, False]],
        "prev_assignment": None,
        "params": {"theta": 0, "copy_budget": 4},
        "cost": {k: getattr(CostModel(), k) for k in COST_KEYS},  # the defaults, written out to show the format
        "target": {"step": 1, "layer": 0, "microbatch": 0},
        "seq": 7,
    }
    demand_path, state_path = out / "demand.json", out / "state.json"
    demand_path.write_text(json.dumps({"demand": demand}) + "\n")
    state_path.write_text(json.dumps(state, indent=1) + "\n")
    return demand_path, state_path


def run(args: argparse.Namespace) -> int:
    if args.example is not None:
        try:
            demand_path, state_path = write_example(args.example)
        except OSError as exc:
            print(f"afore plan: example: cannot write under {args.example!r}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {demand_path} and {state_path}; plan them with:\n"
              f"  afore plan --demand {demand_path} --state {state_path} --out plan.json")
        return 0
    missing = [f"--{name}" for name in ("demand", "state", "out") if getattr(args, name) is None]
    if missing:
        print(f"afore plan: {', '.join(missing)}: required (or --example DIR to write example inputs)", file=sys.stderr)
        return 2
    try:
        doc = plan_document(read_file(args.demand, "demand"), read_file(args.state, "state"), args.shape, args.policy)
    except ValueError as exc:
        print(f"afore plan: {exc}", file=sys.stderr)
        return 2
    errors = verify_plan_json(json.loads(json.dumps(doc)))
    if errors:  # the planner broke the contract: never write a plan that does not verify
        print("afore plan: internal error, the plan does not verify: " + "; ".join(errors[:5]), file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    p = doc["plan"]
    print(f"wrote {args.out}: max tile load {p['max_tile_load']}, {len(p['copies'])} copies, exposed {p['exposed_ms']:.4f} ms")
    return 0


def read_file(path: str, field: str) -> dict | list:
    """JSON object/list or NPZ (as a dict of arrays); ValueError naming ``field`` otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{field}: expected an existing file, got {path!r}")
    if p.suffix == ".npz":
        return read_npz(p, field)
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{field}: expected JSON or .npz in {path!r}, got: {exc}") from None


def _scalar(value: object, field: str) -> object:
    if isinstance(value, np.ndarray):
        if value.shape != ():
            raise ValueError(f"{field}: expected a scalar, got shape {value.shape}")
        return value.item()
    return value


def _int(value: object, field: str) -> int:
    value = _scalar(value, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not np.isfinite(value)) \
            or value != int(value):
        raise ValueError(f"{field}: expected an integer, got {value!r}")
    return int(value)


def parse_shape(state: dict, override: str | None) -> ClusterShape:
    if override is not None:
        parts = override.split(",")
        if len(parts) != 4:
            raise ValueError(f"shape: expected E,F,R,M_tile (4 integers), got {override!r}")
        values = dict(zip(SHAPE_KEYS, (_parse_int(v, "shape") for v in parts)))
    elif isinstance(state.get("shape"), dict):
        values = {k: v for k, v in state["shape"].items()}
    elif all(k in state for k in SHAPE_KEYS):
        values = {k: _int(state[k], k) for k in SHAPE_KEYS}
    else:
        raise ValueError("shape: expected --shape E,F,R,M_tile or a 'shape' object in the state")
    try:
        return msgspec.convert(values, ClusterShape)
    except msgspec.ValidationError as exc:
        raise ValueError(f"shape: {exc}") from None


def _parse_int(text: str, field: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{field}: expected integers, got {text!r}") from None


def _array(value: object, field: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except ValueError:
        raise ValueError(f"{field}: expected a {list(shape)} array") from None
    if arr.shape != shape:
        raise ValueError(f"{field}: expected shape {list(shape)}, got {list(arr.shape)}")
    if kind == "bool":
        if arr.dtype != np.bool_ and not (arr.dtype.kind in "iu" and np.all((arr == 0) | (arr == 1))):
            raise ValueError(f"{field}: expected booleans")
        return arr.astype(bool)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{field}: expected integers, got NaN or non-integer values")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"{field}: expected integers, got {arr.dtype}")
    return arr.astype(np.int64)


def _struct(cls, value: object, field: str):
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise ValueError(f"{field}: expected an object")
    try:
        return msgspec.convert({k: _scalar(v, f"{field}.{k}") for k, v in value.items()}, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{field}: {exc}") from None


def parse_state(state: object, override_shape: str | None):
    """(shape, table, protected, prev_assignment, params, cost, target, seq) from a state document."""
    if not isinstance(state, dict):
        raise ValueError("state: expected a JSON object or an .npz file")
    shape = parse_shape(state, override_shape)
    f, r, e = shape.num_workers, shape.redundant_slots, shape.num_experts
    npz = "slot_expert" in state or any(isinstance(v, np.ndarray) for v in state.values())
    if npz:
        table_doc = {"expert": state.get("slot_expert"), "last_used": state.get("slot_last_used")}
        params_doc = {k: state[k] for k in ("theta", "copy_budget", "chains") if k in state}
        cost_doc = {k: state[k] for k in COST_KEYS if k in state}
        target_doc = {k: state[k] for k in ("step", "layer", "microbatch") if k in state}
        prev = state.get("prev_assignment")
        if isinstance(prev, np.ndarray) and prev.size == 0:
            prev = None
    else:
        table_doc = state.get("slot_table") or {}
        if not isinstance(table_doc, dict):
            raise ValueError("slot_table: expected an object with 'expert' and 'last_used'")
        params_doc, cost_doc, target_doc = state.get("params"), state.get("cost"), state.get("target") or {}
        prev = state.get("prev_assignment")
    expert = table_doc.get("expert")
    last_used = table_doc.get("last_used")
    table = SlotTable(
        np.full((f, r), -1, np.int32) if expert is None else _array(expert, "slot_table.expert", (f, r), "int").astype(np.int32),
        np.full((f, r), -1, np.int64) if last_used is None else _array(last_used, "slot_table.last_used", (f, r), "int"))
    table.check(shape)
    protected = state.get("protected")
    protected = np.zeros((f, r), bool) if protected is None else _array(protected, "protected", (f, r), "bool")
    if prev is not None:
        prev = _array(prev, "prev_assignment", (e, f), "int")
        if np.any(prev < 0):
            raise ValueError("prev_assignment: expected non-negative counts")
        prev = prev.astype(np.int32)
    params = _struct(SchedulerParams, params_doc, "params")
    cost = _struct(CostModel, cost_doc, "cost")
    if not isinstance(target_doc, dict):
        raise ValueError("target: expected an object with step, layer, microbatch")
    target = Target(*(_int(target_doc.get(k, 0), f"target.{k}") for k in ("step", "layer", "microbatch")))
    shape.check_layer(target.layer)
    seq = _int(state.get("seq", 0), "seq")
    if seq < 0:
        raise ValueError(f"seq: expected an integer >= 0, got {seq}")
    return shape, table, protected, prev, params, cost, target, seq


def parse_demand(doc: object, shape: ClusterShape) -> np.ndarray:
    if isinstance(doc, dict):
        if "demand" not in doc:
            raise ValueError("demand: expected a 'demand' key (JSON object or NPZ array)")
        doc = doc["demand"]
    if isinstance(doc, list) and any(isinstance(v, (list, dict, str)) or v is None for v in doc):
        raise ValueError(f"demand: expected a flat list of {shape.num_experts} integer counts")
    return shape.check_demand(np.asarray(doc))


def plan_document(demand_doc: object, state_doc: object, override_shape: str | None, policy_name: str) -> dict:
    """Plan one target and return the self-contained JSON document."""
    from afore.scheduler.policies import Observation, make_policy
    shape, table, protected, prev, params, cost, target, seq = parse_state(state_doc, override_shape)
    demand = parse_demand(demand_doc, shape)
    policy = make_policy(policy_name, shape, params, cost)
    policy.set_state(target.layer, table, protected, prev)
    plan = policy.plan(Observation(target, seq, demand))
    after = policy.layer(target.layer).table
    return {
        "format": "afore-plan/1",
        "inputs": {
            "policy": policy_name,
            "budgeted": policy.BUDGETED,  # at most params.copy_budget copies (plan_verify checks it)
            "shape": {k: getattr(shape, k) for k in ("num_experts", "num_workers", "num_layers", "redundant_slots", "m_tile", "top_k")},
            "demand": demand.tolist(),
            "slot_table": {"expert": table.expert.tolist(), "last_used": table.last_used.tolist()},
            "protected": protected.tolist(),
            "prev_assignment": None if prev is None else prev.tolist(),
            "params": {"theta": params.theta, "copy_budget": params.copy_budget, "chains": params.chains},
            "cost": {**{k: getattr(cost, k) for k in COST_KEYS}, "copy_ms": cost.copy_ms},
            "target": {"step": target.step, "layer": target.layer, "microbatch": target.microbatch},
            "seq": seq,
        },
        "plan": plan.to_json(),
        "slot_table_after": {"expert": after.expert.tolist(), "last_used": after.last_used.tolist()},
    }
