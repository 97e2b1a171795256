"""Primary layouts from files (afore serve --primaries affinity --primaries-file) and the serve option."""

from __future__ import annotations

import json

import numpy as np
import pytest

from afore.affinity.layout import load_primary_layout
from afore.affinity.profile import profile_from_tokens, save_profile
from afore.affinity.token_model import semmoe_synthetic
from afore.serve import launcher
from afore.serve.launcher import ServeOptions


def test_layout_json_and_profile(tmp_path):
    path = tmp_path / "l.json"
    path.write_text(json.dumps({"primaries": [1, 0, 1, 0], "num_workers": 2}))
    assert load_primary_layout(path, 4, 2) == (1, 0, 1, 0)
    with pytest.raises(ValueError, match="primaries_file: the layout is for 2 FFN workers, the pool has 3"):
        load_primary_layout(path, 4, 3)
    with pytest.raises(ValueError, match="primaries: expected one owner worker per expert"):
        load_primary_layout(path, 6, 2)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="primaries_file: expected JSON"):
        load_primary_layout(path, 4, 2)
    with pytest.raises(ValueError, match="primaries_file: expected an existing"):
        load_primary_layout(tmp_path / "missing.json", 4, 2)
    model = semmoe_synthetic(16, 2, num_topics=4, seed=0)
    ids, cls = model.draw(2000, 2, np.random.default_rng(0))
    profile = save_profile(profile_from_tokens([(ids, cls)], 16, 4, [0], model="m", source="s", workload="w",
                                               class_kind="token_type", top_k=2), tmp_path / "p.npz")
    layout = load_primary_layout(profile, 16, 4)
    assert sorted(np.bincount(layout, minlength=4)) == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="the profile has 16 experts, the model 8"):
        load_primary_layout(profile, 8, 4)


def test_serve_option_validation():
    assert ServeOptions().primaries == "contiguous"
    with pytest.raises(ValueError, match="primaries: expected one of contiguous, affinity"):
        ServeOptions(primaries="random")
    with pytest.raises(ValueError, match="primaries_file: --primaries affinity needs --primaries-file"):
        ServeOptions(primaries="affinity")
    assert ServeOptions(primaries="affinity", primaries_file="x.json").primaries_file == "x.json"


def test_the_layout_reaches_the_ffn_workers_in_their_shape(tmp_path):
    """The launcher's one ClusterShape (scheduler and FFN workers alike) carries the layout."""
    from afore.ffn.worker import FFNWorkerConfig

    path = tmp_path / "l.json"
    path.write_text(json.dumps({"primaries": [1, 0, 1, 0, 0, 1, 0, 1], "num_workers": 2}))
    opts = ServeOptions(primaries="affinity", primaries_file=str(path), ffn_workers=2)
    fake = launcher.Launcher.__new__(launcher.Launcher)
    fake.opts, fake._shape = opts, None
    fake.spec = type("Spec", (), {"num_experts": 8, "moe_layer_indices": [0, 1], "top_k": 2})()
    shape = fake.shape()
    assert shape.primaries == (1, 0, 1, 0, 0, 1, 0, 1)
    assert "shape" in FFNWorkerConfig.__struct_fields__
