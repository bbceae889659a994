# Two entry points, each setting up what it needs on a fresh Debian machine with Python 3.11:
#   make train         install, then train the default tiny MoE on the embedded corpus
#   make test          install (with test oracles, Slurm and MPI), then run the test suite
# and one for maintainers, not run by CI:
#   make test-latest   the same with the newest versions pyproject.toml admits (torch stays pinned)
#   make constraints   write constraints.txt from what is installed (after test-latest passed)
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
# The CPU build of torch for machines without a GPU; clusters install their CUDA build first.
TORCH ?= torch==2.13.0
# Versions the suite last passed with, so a new release elsewhere cannot turn a fresh install red.
CONSTRAINTS ?= -c constraints.txt
UPGRADE ?=

.PHONY: setup setup-test train test test-latest constraints

setup:
	$(PIP) $(TORCH)
	$(PIP) $(UPGRADE) $(CONSTRAINTS) -e '.[dev]' $(TORCH)

setup-test: setup
	$(PIP) $(UPGRADE) $(CONSTRAINTS) -e '.[dev]' 'transformers>=4.46' 'megatron-core>=0.12,<0.17' $(TORCH)
	# DeepSpeed's own build environment would pull a CUDA torch; build against the installed one.
	DS_BUILD_OPS=0 $(PIP) $(UPGRADE) $(CONSTRAINTS) --no-build-isolation 'deepspeed>=0.16' $(TORCH)
	bash slurm/install.sh

train: setup
	$(PYTHON) -m moetron train configs/tiny.yaml

test: setup-test
	$(PYTHON) -m pytest -q

test-latest:
	$(MAKE) test CONSTRAINTS= UPGRADE='--upgrade --upgrade-strategy eager'

constraints:
	$(PYTHON) .ci/freeze.py > constraints.txt
