"""afore.serve.vllm_server: vLLM's API server with a draining shutdown and no finalization noise."""

from __future__ import annotations

import subprocess
import sys

from afore.serve.vllm_server import SHUTDOWN_TIMEOUT_S, with_shutdown_timeout
from servers import needs_vllm


def test_shutdown_timeout_added_once_and_only_when_supported():
    assert with_shutdown_timeout(["--model", "m"], True) == ["--model", "m", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    assert with_shutdown_timeout(["--shutdown-timeout", "3"], True) == ["--shutdown-timeout", "3"]
    assert with_shutdown_timeout(["--shutdown-timeout=3"], True) == ["--shutdown-timeout=3"]
    assert with_shutdown_timeout(["--model", "m"], False) == ["--model", "m"]


@needs_vllm
def test_it_is_vllms_server_and_exits_with_its_code():
    ok = subprocess.run([sys.executable, "-m", "afore.serve.vllm_server", "--help"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0 and "--shutdown-timeout" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "afore.serve.vllm_server", "--no-such-option"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr
    assert "nanobind: leaked" not in ok.stderr + bad.stderr
