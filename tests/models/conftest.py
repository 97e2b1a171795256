import os

import pytest

from afore.models.spec import ARCHITECTURES
from afore.models.tiny import build_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """arch -> a tiny checkpoint directory, built once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, root / arch, seed=0) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def hf_models(tiny_dir):
    """arch -> the transformers model loaded from the tiny checkpoint by transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for arch, path in tiny_dir.items()
    }
