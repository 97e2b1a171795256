import pytest
import torch

from afore.models.checkpoint import CheckpointReader, RouterWeights
from afore.models.reference import moe_forward, route
from afore.models.spec import ARCHITECTURES


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reference_layer_equals_the_transformers_moe_block(arch, tiny_dir, hf_models):
    """Spec (routing fields) + reader (weights) reproduce each architecture's own MoE block."""
    reader = CheckpointReader(tiny_dir[arch])
    spec = reader.spec
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(64, spec.hidden_size, generator=generator)
    for layer in spec.moe_layer_indices:
        block = hf_models[arch].model.layers[layer].mlp
        with torch.no_grad():
            expected = block(hidden[None])
        expected = (expected[0] if isinstance(expected, tuple) else expected).reshape(hidden.shape)
        got = moe_forward(spec, reader.load_router(layer), reader.load_routed_experts(layer), hidden,
                          reader.load_shared_experts(layer))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_grouped_topk_only_picks_from_kept_groups(tiny_dir):
    reader = CheckpointReader(tiny_dir["deepseek_v3"])
    spec = reader.spec
    assert (spec.n_group, spec.topk_group) == (4, 2)
    router = reader.load_router(1)
    hidden = torch.randn(256, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    ids, weights = route(spec, router, hidden)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    groups = ids // (spec.num_experts // spec.n_group)
    assert all(len(set(row.tolist())) <= spec.topk_group for row in groups)
    torch.testing.assert_close(weights.sum(-1), torch.full((256,), spec.routed_scaling_factor))
    # The correction bias steers selection only: without it the choice changes for some tokens,
    # while the weights of a selected expert never include the bias.
    unbiased, _ = route(spec, RouterWeights(router.weight, torch.zeros_like(router.correction_bias)), hidden)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)


def test_route_rejects_wrong_hidden_width(tiny_dir):
    reader = CheckpointReader(tiny_dir["qwen3_moe"])
    with pytest.raises(ValueError, match="hidden"):
        route(reader.spec, reader.load_router(0), torch.zeros(3, reader.spec.hidden_size + 1))
