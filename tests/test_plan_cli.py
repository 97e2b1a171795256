"""`afore plan` end to end, and the standalone verifier against good and corrupted plans."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from afore.cli import main
from afore.scheduler import plan_verify
from afore.scheduler.plan_verify import verify_plan_json
from afore.scheduler.policies import POLICY_NAMES, REGISTRY

E, F, R = 16, 4, 2


def _write_inputs(tmp_path, demand=None, **state_overrides):
    rng = np.random.default_rng(0)
    demand = rng.integers(0, 300, E).tolist() if demand is None else demand
    state = {
        "shape": {"num_experts": E, "num_workers": F, "redundant_slots": R, "m_tile": 16},
        "slot_table": {"expert": [[5, -1], [-1, -1], [0, -1], [-1, -1]], "last_used": [[3, -1], [-1, -1], [3, -1], [-1, -1]]},
        "protected": [[True, False], [False, False], [False, False], [False, False]],
        "params": {"theta": 0, "copy_budget": 4},
        "target": {"step": 1, "layer": 0, "microbatch": 0},
        "seq": 7,
    }
    state.update(state_overrides)
    (tmp_path / "d.json").write_text(json.dumps({"demand": demand}))
    (tmp_path / "s.json").write_text(json.dumps(state))
    return tmp_path / "d.json", tmp_path / "s.json"


def _plan(tmp_path, *extra):
    d, s = tmp_path / "d.json", tmp_path / "s.json"
    out = tmp_path / "plan.json"
    rc = main(["plan", "--demand", str(d), "--state", str(s), "--out", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_plan_json_verifies(tmp_path, policy):
    _write_inputs(tmp_path)
    rc, doc = _plan(tmp_path, "--policy", policy)
    assert rc == 0
    assert doc["format"] == "afore-plan/1" and doc["inputs"]["policy"] == policy
    assert doc["inputs"]["budgeted"] is REGISTRY[policy].BUDGETED
    assert verify_plan_json(doc) == []
    p = doc["plan"]
    assert [sum(row) for row in p["assignment"]] == doc["inputs"]["demand"]
    assert p["max_tile_load"] == max(p["tile_load"])


def test_afore_plan_rebalances_and_keeps_protected_slot(tmp_path):
    demand = [0] * E
    demand[1] = 640  # one hot expert on worker 0: 40 tiles
    _write_inputs(tmp_path, demand=demand)
    rc, doc = _plan(tmp_path)
    assert rc == 0
    p = doc["plan"]
    assert p["max_tile_load"] < 40 and len(p["copies"]) >= 1
    assert p["slot"][5][0] == 4  # protected binding: expert 5 stays in worker 0's redundant slot 0 (P_0 = 4)
    assert all(c["dst"] != 0 or c["dst_slot"] != 4 for c in p["copies"])


def test_npz_inputs_and_shape_override(tmp_path):
    demand = np.arange(E) * 10
    np.savez(tmp_path / "d.npz", demand=demand)
    np.savez(tmp_path / "s.npz", slot_expert=np.full((F, R), -1), slot_last_used=np.full((F, R), -1),
             protected=np.zeros((F, R), bool), theta=0, copy_budget=2, step=0, layer=0, microbatch=0, seq=3)
    out = tmp_path / "p.json"
    assert main(["plan", "--demand", str(tmp_path / "d.npz"), "--state", str(tmp_path / "s.npz"),
                 "--shape", f"{E},{F},{R},16", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert verify_plan_json(doc) == [] and doc["inputs"]["seq"] == 3 and doc["inputs"]["params"]["copy_budget"] == 2


@pytest.mark.parametrize("demand, state, message", [
    ([1] * (E - 1), {}, "demand"),
    ([-1] + [1] * (E - 1), {}, "demand"),
    ([1.5] + [1] * (E - 1), {}, "demand"),
    ([1] * E, {"protected": [[True]]}, "protected"),
    ([1] * E, {"slot_table": {"expert": [[99, -1]] * F}}, "slot_table.expert"),
    ([1] * E, {"params": {"theta": -1}}, "params"),
    ([1] * E, {"target": {"step": 0, "layer": 5, "microbatch": 0}}, "layer"),
    ([1] * E, {"shape": {"num_experts": E}}, "shape"),
    ([1] * E, {"prev_assignment": [[1] * F] * (E - 1)}, "prev_assignment"),
])
def test_bad_input_exit_2(tmp_path, capsys, demand, state, message):
    _write_inputs(tmp_path, demand=demand, **state)
    rc, doc = _plan(tmp_path)
    assert rc == 2 and doc is None
    assert message in capsys.readouterr().err


def test_unreadable_files_exit_2(tmp_path, capsys):
    (tmp_path / "d.json").write_text("{not json")
    (tmp_path / "s.json").write_text("{}")
    assert _plan(tmp_path)[0] == 2
    assert "demand" in capsys.readouterr().err
    assert main(["plan", "--demand", str(tmp_path / "absent.json"), "--state", str(tmp_path / "s.json"), "--out", str(tmp_path / "o.json")]) == 2


def _corruptions():
    def bump_assignment(doc):
        doc["plan"]["assignment"][1][0] += 1
    def split_partial(doc):
        row = doc["plan"]["assignment"][1]
        w = [i for i, v in enumerate(row) if v >= 16][0]
        other = [i for i in range(F) if i != w and i in doc["plan"]["replica_sets"][1]][0]
        row[w] -= 3
        row[other] += 3
        doc["plan"]["tiles"][1] = [-(-v // 16) for v in row]
        tl = [sum(doc["plan"]["tiles"][e][x] for e in range(E)) for x in range(F)]
        doc["plan"]["tile_load"], doc["plan"]["max_tile_load"] = tl, max(tl)
    def wrong_tile_load(doc):
        doc["plan"]["tile_load"][0] -= 1
    def drop_copy(doc):
        doc["plan"]["copies"].pop()
    def copy_from_wrong_worker(doc):
        c = doc["plan"]["copies"][0]
        c["src"] = (c["src"] + 1) % F
    def copy_into_protected(doc):
        doc["inputs"]["protected"] = [[True, True]] * F
    def work_without_replica(doc):
        e = 2  # primary on worker 0
        doc["plan"]["assignment"][e][0] -= 16
        doc["plan"]["assignment"][e][3] += 16
    def over_budget(doc):
        doc["inputs"]["params"]["copy_budget"] = 0
    def primary_moved(doc):
        doc["plan"]["slot"][0][0] = 3
    def budgeted_missing(doc):
        del doc["inputs"]["budgeted"]
    return [bump_assignment, split_partial, wrong_tile_load, drop_copy, copy_from_wrong_worker, copy_into_protected,
            work_without_replica, over_budget, primary_moved, budgeted_missing]


@pytest.mark.parametrize("corrupt", _corruptions(), ids=lambda f: f.__name__)
def test_verifier_catches_corruption(tmp_path, corrupt):
    demand = [64] * E
    demand[1] = 640
    _write_inputs(tmp_path, demand=demand)
    rc, doc = _plan(tmp_path)
    assert rc == 0 and verify_plan_json(doc) == [] and doc["plan"]["copies"]
    bad = copy.deepcopy(doc)
    corrupt(bad)
    assert verify_plan_json(bad) != []


def test_unbudgeted_plan_may_exceed_the_budget_budgeted_may_not(tmp_path):
    demand = [64] * E
    demand[1] = 640
    _write_inputs(tmp_path, demand=demand)
    rc, doc = _plan(tmp_path)
    assert rc == 0 and len(doc["plan"]["copies"]) >= 1
    doc["inputs"]["params"]["copy_budget"] = 0
    assert any("budget" in e for e in verify_plan_json(doc))
    doc["inputs"]["budgeted"] = False  # what EPLB's plans declare: the budget does not apply
    assert verify_plan_json(doc) == []


def test_verifier_script_is_standalone(tmp_path):
    _write_inputs(tmp_path)
    rc, doc = _plan(tmp_path)
    script = Path(plan_verify.__file__)
    source = script.read_text()
    imports = [line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert set(imports) <= {"__future__", "json", "sys"}
    copied = tmp_path / "verify.py"
    copied.write_text(source)
    ok = subprocess.run([sys.executable, "-S", str(copied), str(tmp_path / "plan.json")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok")
    doc["plan"]["assignment"][0][0] += 1
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    bad = subprocess.run([sys.executable, "-S", str(copied), str(tmp_path / "bad.json")], capture_output=True, text=True)
    assert bad.returncode == 1 and "assignment" in bad.stdout


def test_example_inputs_round_trip(tmp_path, capsys):
    assert main(["plan", "--example", str(tmp_path / "ex")]) == 0
    printed = capsys.readouterr().out
    demand, state = tmp_path / "ex" / "demand.json", tmp_path / "ex" / "state.json"
    assert f"--demand {demand} --state {state}" in printed
    out = tmp_path / "plan.json"
    assert main(["plan", "--demand", str(demand), "--state", str(state), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert verify_plan_json(doc) == []
    assert doc["inputs"]["demand"] == json.loads(demand.read_text())["demand"]
    assert doc["inputs"]["seq"] == json.loads(state.read_text())["seq"]
    assert doc["plan"]["copies"], "the example's hot expert should be replicated"


def test_plan_without_inputs_names_the_missing_options(tmp_path, capsys):
    assert main(["plan", "--demand", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err
    assert "--state" in err and "--out" in err and "--example" in err and "--demand," not in err


def test_plan_help_shows_the_file_formats(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "slot_table" in out and "prev_assignment" in out and "--example" in out
