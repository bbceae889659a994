# Two entry points, each setting up what it needs on a fresh Debian machine with Python 3.11:
#   make train   install, then train the default tiny MoE on the embedded corpus
#   make test    install (with test oracles, Slurm and MPI), then run the test suite
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The CPU build of torch for machines without a GPU; clusters install their CUDA build first.
TORCH ?= torch==2.13.0

.PHONY: setup setup-test train test

setup:
	$(PIP) install --quiet --disable-pip-version-check $(TORCH)
	$(PIP) install --quiet --disable-pip-version-check -e '.[dev]'

setup-test: setup
	$(PIP) install --quiet --disable-pip-version-check -e '.[dev]' 'transformers>=4.46' 'megatron-core>=0.12,<0.17'
	# DeepSpeed's own build environment would pull a CUDA torch; build against the installed one.
	$(PYTHON) -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(PIP) install --quiet \
		--disable-pip-version-check --no-build-isolation 'deepspeed>=0.16'
	bash slurm/install.sh

train: setup
	$(PYTHON) -m moetron train configs/tiny.yaml

test: setup-test
	$(PYTHON) -m pytest -q
