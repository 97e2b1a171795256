"""Shared fixtures: tiny checkpoints (built once, cached) and log directory for server output."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from servers import needs_vllm, tiny  # noqa: E402,F401 (test modules import them from servers)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("serve-logs"))


@pytest.fixture(scope="session")
def qwen3_model() -> str:
    return tiny("qwen3_moe")


_BATCHED: list[dict] = []


@pytest.fixture(scope="session")
def qwen3_reference(qwen3_model, log_dir) -> list[dict]:
    """Plain vLLM's greedy outputs on the tiny Qwen3-MoE (one server start per session)."""
    from servers import reference

    return reference(qwen3_model, os.path.join(log_dir, "plain-qwen3.log"), batched=_BATCHED)


@pytest.fixture(scope="session")
def qwen3_batched_reference(qwen3_reference) -> list[dict]:
    """Plain vLLM's outputs of all PROMPTS in one request (``Server.batched``), same server."""
    assert _BATCHED, "the plain reference server gave no batched outputs"
    return _BATCHED


@pytest.fixture
def started(monkeypatch) -> list[tuple[list[str], dict | None]]:
    """The launcher's children, recorded instead of started: (command, environment) of every
    ``subprocess.Popen`` in ``afore.serve.launcher``, in order; each looks alive."""
    import afore.serve.launcher as launcher_mod

    calls: list[tuple[list[str], dict | None]] = []

    class FakePopen:
        def __init__(self, cmd, env=None, **kw):
            calls.append((cmd, env))
            self.pid = 0

        def poll(self):
            return None

    monkeypatch.setattr(launcher_mod.subprocess, "Popen", FakePopen)
    return calls
