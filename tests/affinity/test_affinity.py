"""Affinity profiles, co-clustered primaries and fan-out (afore.affinity)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from afore.affinity import cocluster, fanout, olmoe
from afore.affinity.profile import AffinityProfile, DemandProfiler, load_profile, profile_from_tokens, save_profile
from afore.affinity.token_model import TokenModel, semmoe_synthetic
from afore.cli import main
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.ffn.partition import worker_mask
from afore.plan import SlotTable, Target, primary_only_plan
from afore.scheduler import core


def planted(e: int, f: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Co-activation with f hidden groups of e/f experts (strong inside, weak across), shuffled ids."""
    group = rng.permutation(np.arange(e) % f)
    c = np.where(group[:, None] == group[None, :], 10.0, 1.0) + rng.random((e, e)) * 0.1
    c = (c + c.T) / 2
    return c, np.ones(e), group


@pytest.mark.parametrize("e, f", [(16, 4), (64, 8), (64, 32), (30, 4)])
def test_co_cluster_recovers_planted_groups_with_contiguous_sizes(e, f):
    c, load, group = planted(e, f, np.random.default_rng(e + f))
    owner = cocluster.co_cluster(c, load, f, load_slack=0.5)
    sizes = ClusterShape(num_experts=e, num_workers=f, top_k=1).primary_counts
    assert sorted(np.bincount(owner, minlength=f)) == sorted(sizes)
    if e % f == 0:   # every planted group lands in one set
        assert all(len(set(owner[group == g])) == 1 for g in range(f))
        assert cocluster.in_set_share(c, owner) > cocluster.in_set_share(c, np.arange(e) % f)


def test_co_cluster_respects_the_load_cap():
    rng = np.random.default_rng(0)
    e, f = 32, 4
    c, _, group = planted(e, f, rng)
    load = np.where(group == 0, 5.0, 1.0)   # the planted group 0 alone would be 2.5x the mean
    owner = cocluster.co_cluster(c, load, f, load_slack=0.1)
    assert cocluster.set_load_ratio(load, owner, f) <= 1.1 + 1e-9
    loose = cocluster.co_cluster(c, load, f, load_slack=10.0)
    assert cocluster.in_set_share(c, loose) >= cocluster.in_set_share(c, owner)


@pytest.mark.parametrize("kwargs, field", [
    ({"coactivation": np.ones((3, 3)), "load": np.ones(4), "num_workers": 2}, "coactivation"),
    ({"coactivation": np.ones((4, 4)), "load": np.ones(4), "num_workers": 5}, "num_workers"),
    ({"coactivation": -np.ones((4, 4)), "load": np.ones(4), "num_workers": 2}, "coactivation"),
    ({"coactivation": np.ones((4, 4)), "load": np.ones(4), "num_workers": 2, "load_slack": -1}, "load_slack"),
])
def test_co_cluster_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        cocluster.co_cluster(**kwargs)


def test_token_model_draws_distinct_experts_with_the_class_distribution():
    prob = np.array([[0.7, 0.1, 0.1, 0.1, 0.0, 0.0], [0.0, 0.0, 0.1, 0.1, 0.1, 0.7]])
    model = TokenModel(np.array([3.0, 1.0]), prob, "test")
    ids, classes = model.draw(40_000, 2, np.random.default_rng(1))
    assert ids.shape == (40_000, 2) and np.all(ids[:, 0] != ids[:, 1])
    assert abs(np.mean(classes == 0) - 0.75) < 0.01
    first = np.bincount(ids[classes == 0, 0], minlength=6) / np.sum(classes == 0)
    assert abs(first[0] - 0.7) < 0.01 and first[4] == 0 and first[5] == 0
    s = model.structure()
    assert s["class_entropy_nats"] < s["marginal_entropy_nats"] <= s["uniform_entropy_nats"]


def test_token_model_rejects_bad_input():
    with pytest.raises(ValueError, match="expert_prob"):
        TokenModel(np.ones(2), np.ones((3, 4)), "x")
    with pytest.raises(ValueError, match="top_k"):
        TokenModel(np.ones(1), np.ones((1, 4)), "x").sample(3, 5, np.random.default_rng(0))


def test_distinct_per_row_and_primary_fan_out():
    owner = np.array([0, 0, 1, 1, 2, 2])
    ids = np.array([[0, 1], [0, 2], [5, 3], [4, 5]])
    assert fanout.distinct_per_row(fanout.primary_workers(ids, owner)).tolist() == [1, 2, 2, 1]
    assert fanout.bytes_per_token(2, hidden_size=10, top_k=2, activation_bytes=2) == 2 * 2 * 10 * 2 + 2 * 8


def test_plan_workers_is_the_ffn_partition():
    rng = np.random.default_rng(5)
    shape = ClusterShape(num_experts=16, num_workers=4, redundant_slots=2, m_tile=2, top_k=4,
                         primaries=tuple(int(w) for w in rng.permutation(np.arange(16) % 4)))
    model = semmoe_synthetic(16, 4, num_topics=4, seed=2)
    ids = model.sample(300, 4, rng)
    demand = np.bincount(ids.reshape(-1), minlength=16)
    plan, _ = core.schedule(shape, demand, SlotTable.empty(shape), np.zeros((4, 2), bool), None,
                            SchedulerParams(copy_budget=4), CostModel(window_ms=10.0), Target(0, 0, 0), 0)
    assert len(plan.copies) > 0     # the test exercises replicas, not only primaries
    workers = fanout.plan_workers(ids, plan, shape.primary_owner)
    owner_t = torch.as_tensor(shape.primary_owner)
    for w in range(4):
        mask = worker_mask(torch.as_tensor(ids), torch.as_tensor(plan.assignment), owner_t, w).numpy()
        assert np.array_equal(mask, workers.reshape(-1) == w)
    primary = fanout.plan_workers(ids, primary_only_plan(shape, demand, Target(0, 0, 0), 0), shape.primary_owner)
    assert np.array_equal(primary, fanout.primary_workers(ids, shape.primary_owner))
    with pytest.raises(ValueError, match="plan.demand"):
        fanout.plan_workers(ids[:-1], plan, shape.primary_owner)


def test_profile_from_tokens_counts_and_round_trips(tmp_path):
    ids = np.array([[0, 1], [1, 2], [0, 1]])
    profile = profile_from_tokens([(ids, np.array([0, 1, 0]))], num_experts=3, num_classes=2, layers=[5],
                                  model="m", source="s", workload="w", class_kind="token_type", top_k=2)
    assert profile.coactivation[0].tolist() == [[2, 2, 0], [2, 3, 1], [0, 1, 1]]
    assert profile.load[0].tolist() == [2, 3, 1]
    assert profile.class_expert[0].tolist() == [[2, 2, 0], [0, 1, 1]]
    back = load_profile(save_profile(profile, tmp_path / "p"))
    assert np.array_equal(back.coactivation, profile.coactivation) and back.layers.tolist() == [5]
    assert (back.model, back.class_kind, back.coactivation_kind, back.top_k) == ("m", "token_type", "token", 2)


def test_profile_rejects_bad_fields(tmp_path):
    good = dict(coactivation=np.eye(3)[None], load=np.ones((1, 3)), class_expert=np.ones((1, 1, 3)),
                tokens=np.array([3]), layers=np.array([0]), model="m", source="s", workload="w",
                class_kind="token_type", coactivation_kind="token", top_k=1)
    AffinityProfile(**good)
    for field, value in [("load", np.ones((1, 4))), ("class_kind", "nope"), ("top_k", 4),
                         ("coactivation", np.array([[[0, 1, 0], [0, 0, 0], [0, 0, 0]]], float))]:
        with pytest.raises(ValueError, match=field):
            AffinityProfile(**{**good, field: value})
    np.savez(tmp_path / "bad.npz", load=np.ones(3))
    with pytest.raises(ValueError, match="coactivation: missing"):
        load_profile(tmp_path / "bad.npz")
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="profile: .*empty.npz.* is not a readable .npz"):
        load_profile(tmp_path / "empty.npz")


def test_demand_profiler_per_attention_worker():
    prof = DemandProfiler(num_experts=4, num_layers=2, num_workers=2, top_k=2)
    prof.add(0, 0, np.array([4, 0, 0, 0]))
    prof.add(0, 1, np.array([0, 2, 2, 0]))
    prof.add(1, 1, np.array([1, 1, 1, 1]))
    p = prof.profile(model="m", source="s", workload="w")
    assert p.class_kind == "attention_worker" and p.coactivation_kind == "microbatch"
    assert p.class_expert[0].tolist() == [[4, 0, 0, 0], [0, 2, 2, 0]]
    assert np.diag(p.coactivation[0]).tolist() == [4, 2, 2, 0]
    assert p.coactivation[0, 1, 2] == pytest.approx(2 * 2 * 2 / 4)   # k d_i d_j / pairs
    assert p.tokens.tolist() == [4, 2]
    for args, field in [((2, 0, np.zeros(4, int)), "layer"), ((0, 2, np.zeros(4, int)), "worker"),
                        ((0, 0, np.zeros(3, int)), "demand"), ((0, 0, -np.ones(4, int)), "demand")]:
        with pytest.raises(ValueError, match=field):
            prof.add(*args)
    assert prof.reports == 3


def test_cli_writes_profile_plot_and_layout(tmp_path, capsys):
    out = tmp_path / "p.npz"
    layout = tmp_path / "l.json"
    rc = main(["profile", "affinity", "--source", "synthetic", "--experts", "16", "--top-k", "4", "--tokens", "5000",
               "--out", str(out), "--workers", "4", "--layout-out", str(layout)])
    assert rc == 0
    assert out.is_file() and out.with_suffix(".png").is_file()
    data = json.loads(layout.read_text())
    assert sorted(np.bincount(data["primaries"], minlength=4)) == [4, 4, 4, 4]
    ClusterShape(num_experts=16, num_workers=4, top_k=4, primaries=tuple(data["primaries"]))
    assert main(["profile", "affinity", "--source", "trace", "--out", str(tmp_path / "x.npz")]) == 2
    assert "--trace: required" in capsys.readouterr().err


def test_olmoe_token_model_from_the_real_traces():
    folder = olmoe.find_olmoe_dir()
    # the traces are on every development and CI machine (../shared/traces): missing is a failure
    assert folder is not None, "../shared/traces/olmoe not found: the OLMoE token model cannot be tested"
    counts = olmoe.read_crosslayer(folder)
    model = olmoe.token_model(counts, (7, 15), ["c4", "github"])
    assert model.num_experts == 64 and model.num_classes == 64
    assert np.allclose(model.expert_prob.sum(axis=1), 1.0)
    s = model.structure()
    assert s["class_entropy_nats"] < s["marginal_entropy_nats"]   # the class carries information
    with pytest.raises(ValueError, match="domains"):
        olmoe.token_model(counts, (7, 15), ["nope"])
    mixture = olmoe.token_model(counts, (7, 15), ["c4", "github"], per_domain=True)
    assert mixture.num_classes == 128
    assert np.allclose(mixture.expert_load(), model.expert_load())     # same measured marginal
    assert mixture.structure()["class_entropy_nats"] < s["class_entropy_nats"]   # a token's domain says more


def test_token_aware_plan_workers_keep_the_plan_and_cut_fanout():
    rng = np.random.default_rng(8)
    shape = ClusterShape(num_experts=16, num_workers=4, redundant_slots=2, m_tile=2, top_k=4,
                         primaries=tuple(int(w) for w in rng.permutation(np.arange(16) % 4)))
    ids = semmoe_synthetic(16, 4, num_topics=4, seed=3).sample(400, 4, rng)
    demand = np.bincount(ids.reshape(-1), minlength=16)
    plan, _ = core.schedule(shape, demand, SlotTable.empty(shape), np.zeros((4, 2), bool), None,
                            SchedulerParams(copy_budget=4), CostModel(window_ms=10.0), Target(0, 0, 0), 0)
    assert plan.copies.shape[0] > 0     # replicas exist, so the partitions can differ
    workers = fanout.plan_workers(ids, plan, shape.primary_owner, token_aware=True)
    got = np.zeros((16, 4), np.int64)
    np.add.at(got, (ids.reshape(-1), workers.reshape(-1)), 1)
    assert np.array_equal(got, plan.assignment)          # the plan's counts, exactly
    assert np.all(plan.replicas[ids.reshape(-1), workers.reshape(-1)])
    eq11 = fanout.distinct_per_row(fanout.plan_workers(ids, plan, shape.primary_owner)).mean()
    assert fanout.distinct_per_row(workers).mean() < eq11


def planted_tokens(e: int, f: int, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Tokens whose k experts all lie in one of f hidden groups of e/f experts (shuffled ids)."""
    group = rng.permutation(np.arange(e) % f)
    members = [np.flatnonzero(group == g) for g in range(f)]
    ids = np.stack([rng.choice(members[rng.integers(f)], k, replace=False) for _ in range(n)])
    return ids, group


@pytest.mark.parametrize("e, f, k", [(16, 4, 3), (64, 8, 8)])
def test_fanout_cluster_finds_planted_groups(e, f, k):
    rng = np.random.default_rng(e + f)
    ids, _ = planted_tokens(e, f, 3000, k, rng)
    owner = cocluster.fanout_cluster(ids, e, f, load_slack=0.5)
    assert sorted(np.bincount(owner, minlength=f)) == sorted(ClusterShape(num_experts=e, num_workers=f, top_k=1).primary_counts)
    assert cocluster.mean_fanout(ids, owner) == 1.0
    assert cocluster.mean_fanout(ids, np.arange(e) % f) > 1.5


def test_fanout_cluster_beats_both_starts_and_keeps_the_cap():
    rng = np.random.default_rng(4)
    model = semmoe_synthetic(32, 4, num_topics=12, seed=5)
    ids = model.sample(4000, 4, rng)
    load = np.bincount(ids.reshape(-1), minlength=32).astype(float)
    owner = cocluster.fanout_cluster(ids, 32, 4, load_slack=0.1, restarts=2)
    assert cocluster.set_load_ratio(load, owner, 4) <= 1.1 + 1e-9
    onehot = np.zeros((len(ids), 32))
    np.put_along_axis(onehot, ids, 1.0, axis=1)
    pairwise = cocluster.co_cluster(onehot.T @ onehot, load, 4, 0.1)
    contiguous = np.arange(32) // 8
    if cocluster.set_load_ratio(load, contiguous, 4) <= 1.1:
        assert cocluster.mean_fanout(ids, owner) <= cocluster.mean_fanout(ids, contiguous)
    assert cocluster.mean_fanout(ids, owner) <= cocluster.mean_fanout(ids, pairwise)
    skewed = np.where(np.arange(32) < 4, 6.0, 1.0)       # four hot experts: the cap binds
    capped = cocluster.fanout_cluster(ids, 32, 4, load=skewed, load_slack=0.1, restarts=1)
    assert cocluster.set_load_ratio(skewed, capped, 4) <= 1.1 + 1e-9
    with pytest.raises(ValueError, match="topk_ids"):
        cocluster.fanout_cluster(np.array([[0, 40]]), 32, 4)
    with pytest.raises(ValueError, match="num_workers"):
        cocluster.fanout_cluster(ids, 32, 33)


def test_fanout_lower_bound_holds_for_any_layout_and_is_tight_when_it_can_be():
    rng = np.random.default_rng(6)
    model = semmoe_synthetic(16, 4, num_topics=6, seed=2)
    sizes = np.full(4, 4)
    bound = fanout.fanout_lower_bound(model.weight, model.expert_prob, 4, sizes)
    ids = model.sample(20_000, 4, rng)
    for owner in [np.arange(16) // 4, np.arange(16) % 4, cocluster.fanout_cluster(ids, 16, 4, load_slack=10.0)]:
        assert bound <= cocluster.mean_fanout(ids, owner) + 0.01
    # every class in its own layout (the bench's estimate) sits between the bound and a shared layout
    from afore.bench.affinity import per_class_layout_fanout
    own = per_class_layout_fanout(model, 4, (4, 4, 4, 4), 20_000, rng)
    assert bound - 0.01 <= own <= cocluster.mean_fanout(ids, cocluster.fanout_cluster(ids, 16, 4, load_slack=10.0)) + 0.01
    # one class on experts 0..3: every token draws exactly those four; a layout grouping them costs 1
    prob = np.zeros((1, 8))
    prob[0, :4] = [0.4, 0.3, 0.2, 0.1]
    tight = TokenModel(np.ones(1), prob, "test")
    assert fanout.fanout_lower_bound(tight.weight, tight.expert_prob, 4, np.array([4, 4])) == pytest.approx(1.0)
    assert cocluster.mean_fanout(tight.sample(500, 4, rng), np.array([0, 0, 0, 0, 1, 1, 1, 1])) == 1.0
    with pytest.raises(ValueError, match="set_sizes"):
        fanout.fanout_lower_bound(model.weight, model.expert_prob, 4, np.array([4, 4]))
