"""afore.serve.vllm_server: vLLM's API server, ended without interpreter finalization noise."""

from __future__ import annotations

import subprocess
import sys

from servers import needs_vllm


@needs_vllm
def test_it_is_vllms_server_and_exits_with_its_code():
    ok = subprocess.run([sys.executable, "-m", "afore.serve.vllm_server", "--help"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0 and "--max-model-len" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "afore.serve.vllm_server", "--no-such-option"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr
