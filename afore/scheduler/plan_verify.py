#!/usr/bin/env python3
"""Verify an ``afore plan`` JSON with nothing but the Python standard library.

Usage: ``python plan_verify.py plan.json`` (exit 0: valid, 1: violations listed, 2: unreadable).
This file imports nothing from afore or numpy on purpose: copy it anywhere and check a plan
independently of the code that made it.

It recomputes from ``inputs`` (shape, demand, slot table before, protected slots, params):
fixed primaries (contiguous blocks; the first E mod F workers own one more), then checks that the
assignment covers the demand exactly, work runs only on replicas, tiles = ceil(a / M_tile) with at
most one partial tile per expert, tile loads are the column sums, slots are within K_w and
distinct, primaries sit at their fixed slots, every new redundant binding has a copy from the
primary, no copy overwrites a protected slot, and, when ``inputs.budgeted`` is true (the policy
keeps a per-target copy budget: every policy but static and EPLB), at most B copies.
"""

from __future__ import annotations

import json
import sys


def _primaries(num_experts: int, num_workers: int) -> tuple[list[int], list[int], list[int]]:
    """(owner[e], slot of e on its owner, primary count per worker)."""
    base, extra = divmod(num_experts, num_workers)
    counts = [base + (1 if w < extra else 0) for w in range(num_workers)]
    owner, slot = [], []
    for w, n in enumerate(counts):
        owner += [w] * n
        slot += list(range(n))
    return owner, slot, counts


def _matrix(doc: dict, key: str, rows: int, cols: int, errors: list[str]) -> list[list[int]] | None:
    m = doc.get(key)
    if not isinstance(m, list) or len(m) != rows or any(not isinstance(r, list) or len(r) != cols for r in m):
        errors.append(f"{key}: expected a {rows} x {cols} list of lists")
        return None
    if any(not isinstance(v, int) or isinstance(v, bool) for r in m for v in r):
        errors.append(f"{key}: expected integers")
        return None
    return m


def verify_plan_json(doc: object) -> list[str]:
    """All violations found in an ``afore plan`` document (empty list: the plan is valid)."""
    errors: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), dict) or not isinstance(doc.get("plan"), dict):
        return ["document: expected an object with 'inputs' and 'plan'"]
    inp, plan = doc["inputs"], doc["plan"]
    try:
        shape = inp["shape"]
        E, F, R, M = (int(shape[k]) for k in ("num_experts", "num_workers", "redundant_slots", "m_tile"))
        demand = [int(v) for v in inp["demand"]]
        table = inp["slot_table"]["expert"]
        protected = inp["protected"]
        budget = int(inp["params"]["copy_budget"])
    except (KeyError, TypeError, ValueError):
        return ["inputs: expected shape, demand, slot_table.expert, protected and params.copy_budget"]
    if len(demand) != E or any(d < 0 for d in demand):
        errors.append(f"inputs.demand: expected {E} non-negative counts")
        return errors
    if not (isinstance(table, list) and len(table) == F and all(isinstance(r, list) and len(r) == R for r in table)
            and isinstance(protected, list) and len(protected) == F and all(isinstance(r, list) and len(r) == R for r in protected)):
        return errors + [f"inputs.slot_table.expert and inputs.protected: expected {F} x {R} lists"]
    owner, pslot, pcount = _primaries(E, F)
    if plan.get("demand") != demand:
        errors.append("plan.demand: differs from inputs.demand")
    a = _matrix(plan, "assignment", E, F, errors)
    tiles = _matrix(plan, "tiles", E, F, errors)
    slot = _matrix(plan, "slot", E, F, errors)
    if a is None or tiles is None or slot is None:
        return errors
    sets = plan.get("replica_sets")
    if not isinstance(sets, list) or len(sets) != E:
        return errors + [f"replica_sets: expected {E} lists"]
    for e in range(E):
        row = a[e]
        if any(v < 0 for v in row):
            errors.append(f"assignment: expert {e} has a negative count")
        if sum(row) != demand[e]:
            errors.append(f"assignment: expert {e} sums to {sum(row)}, demand is {demand[e]}")
        replicas = set(sets[e])
        if owner[e] not in replicas:
            errors.append(f"replica_sets: expert {e} lacks its primary worker {owner[e]}")
        if slot[e][owner[e]] != pslot[e]:
            errors.append(f"slot: expert {e} not at its fixed primary slot {pslot[e]} on worker {owner[e]}")
        for w in range(F):
            if row[w] > 0 and w not in replicas:
                errors.append(f"assignment: expert {e} has work on worker {w} without a replica")
            if (slot[e][w] >= 0) != (w in replicas):
                errors.append(f"slot: expert {e} on worker {w} does not match replica_sets")
            if tiles[e][w] != -(-row[w] // M):
                errors.append(f"tiles: expert {e} on worker {w} is {tiles[e][w]}, expected ceil({row[w]} / {M})")
        if sum(1 for v in row if v % M) > 1:
            errors.append(f"assignment: expert {e} has more than one partial tile")
    loads = [sum(tiles[e][w] for e in range(E)) for w in range(F)]
    if plan.get("tile_load") != loads:
        errors.append(f"tile_load: expected the column sums of tiles {loads}")
    if plan.get("max_tile_load") != max(loads, default=0):
        errors.append(f"max_tile_load: expected {max(loads, default=0)}")
    for w in range(F):
        used = [slot[e][w] for e in range(E) if slot[e][w] >= 0]
        if len(set(used)) != len(used):
            errors.append(f"slot: worker {w} has two experts in one slot")
        if any(s >= pcount[w] + R for s in used):
            errors.append(f"slot: worker {w} uses a slot beyond K_w = {pcount[w] + R}")
        for e in range(E):
            if owner[e] != w and 0 <= slot[e][w] < pcount[w]:
                errors.append(f"slot: expert {e} on worker {w} in a primary slot")
    copies = plan.get("copies")
    if not isinstance(copies, list):
        return errors + ["copies: expected a list"]
    copied = set()
    for c in copies:
        try:
            e, src, dst, s = int(c["expert"]), int(c["src"]), int(c["dst"]), int(c["dst_slot"])
        except (KeyError, TypeError, ValueError):
            errors.append("copies: expected objects with expert, src, dst, dst_slot")
            continue
        if not (0 <= e < E and 0 <= dst < F):
            errors.append(f"copies: expert {e} or worker {dst} out of range")
            continue
        if src != owner[e]:
            errors.append(f"copies: expert {e} copied from {src}, not its primary {owner[e]}")
        if slot[e][dst] != s or s < pcount[dst]:
            errors.append(f"copies: expert {e} into worker {dst} slot {s} does not match the slot bindings")
        elif protected[dst][s - pcount[dst]]:
            errors.append(f"copies: expert {e} overwrites protected slot {s} of worker {dst}")
        copied.add((e, dst))
    for e in range(E):
        for w in range(F):
            if w == owner[e] or slot[e][w] < 0:
                continue
            r = slot[e][w] - pcount[w]
            if 0 <= r < R and table[w][r] != e and (e, w) not in copied:
                errors.append(f"copies: new replica of expert {e} on worker {w} has no copy")
    for w in range(F):
        for r in range(R):
            e = table[w][r]
            if protected[w][r] and e >= 0 and slot[e][w] != pcount[w] + r:
                errors.append(f"slot: protected slot {r} of worker {w} lost its expert {e}")
    budgeted = inp.get("budgeted")
    if not isinstance(budgeted, bool):
        errors.append(f"budgeted: expected true or false (whether the policy keeps the copy budget B), got {budgeted!r}")
    elif budgeted and len(copies) > budget:
        errors.append(f"copies: {len(copies)} copies, budget B is {budget}")
    after = doc.get("slot_table_after")
    if isinstance(after, dict) and isinstance(after.get("expert"), list):
        for w in range(F):
            for r in range(R):
                e = after["expert"][w][r]
                if e >= 0 and slot[e][w] != pcount[w] + r:
                    errors.append(f"slot_table_after: worker {w} slot {r} holds {e}, the plan does not bind it there")
    if not isinstance(plan.get("exposed_ms"), (int, float)) or plan["exposed_ms"] < 0:
        errors.append("exposed_ms: expected a number >= 0")
    return errors


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: plan_verify.py PLAN.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as fh:
            doc = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"plan_verify: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 2
    errors = verify_plan_json(doc)
    for err in errors:
        print(err)
    if not errors:
        print(f"ok: valid plan, max tile load {doc['plan']['max_tile_load']}, {len(doc['plan']['copies'])} copies")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
