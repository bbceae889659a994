# Two entry points, each setting up what it needs on a fresh Debian machine with Python 3.11:
#   make train         create .venv/, install moetron into it, train the default tiny MoE on the embedded corpus
#   make test          the same with the test oracles, plus Slurm and Open MPI from apt (as root), then run the
#                      test suite; the local Slurm the tests start is stopped again at the end
#   make stop          stop the local Slurm slurm/start.sh started (munged, mariadbd, slurmdbd, slurmctld and
#                      its slurmscriptd, slurmd)
# and one for maintainers, not run by CI:
#   make test-latest   the same with the newest versions pyproject.toml admits (torch stays pinned)
#   make constraints   write constraints.txt from what is installed (after test-latest passed)
#   make gpu-wheels    download into bench/wheels/ what bench/gpu_check.sh installs on a GPU machine without
#                      a package registry (torchao, for train.precision fp8)
#
# Every Python package goes into the project's own virtual environment, .venv/, never into the system's
# interpreter; everything the tests start (torchrun, mpirun, srun, Slurm batch jobs) runs .venv/bin/python.
BASE_PYTHON ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
# pip installs torch, since a machine's pip configuration may name a local folder holding its CPU build;
# uv installs everything else: it resolves, downloads, unpacks and byte-compiles in parallel (`make setup-test`
# took 48 s on 2 cores with empty caches, 96 s with pip alone) and installs the same versions.
UV := $(VENV)/bin/uv
UV_VERSION ?= uv==0.13.10
# --system-certs: trust the machine's certificate store, as pip does (a registry behind a proxy with its own
# certificate authority is refused otherwise).
UV_PIP := $(UV) pip install --quiet --compile-bytecode --system-certs --python $(PYTHON)
# The CPU build of torch for machines without a GPU; clusters install their CUDA build first.
TORCH ?= torch==2.13.0
# Versions the suite last passed with, so a new release elsewhere cannot turn a fresh install red.
CONSTRAINTS ?= -c constraints.txt
UPGRADE ?=
# pytest workers: the Slurm tests, which mostly wait on the scheduler, share one; the rest of the suite
# fills both cores (tests/slurm/conftest.py). More workers than cores only slows the multi-rank tests.
TEST_WORKERS ?= 2

.PHONY: setup setup-test train test stop test-latest constraints gpu-wheels

# bin/pip appears only once venv's ensurepip succeeded, so a half-made .venv/ is completed next time.
$(VENV)/bin/pip:
	@$(BASE_PYTHON) -m venv $(VENV) || { echo "make: '$(BASE_PYTHON) -m venv $(VENV)' failed; on Debian install python3-venv (apt-get install python3-venv) and run make again" >&2; exit 1; }

$(UV): $(VENV)/bin/pip
	$(PIP) '$(UV_VERSION)'

setup: $(UV)
	$(PIP) $(TORCH)
	$(UV_PIP) $(UPGRADE) $(CONSTRAINTS) -e '.[dev]' $(TORCH)

setup-test: setup
	$(UV_PIP) $(UPGRADE) $(CONSTRAINTS) -e '.[dev]' 'transformers>=4.46' 'megatron-core>=0.12,<0.17' $(TORCH)
	# DeepSpeed's own build environment would pull a CUDA torch; build against the installed one.
	DS_BUILD_OPS=0 $(UV_PIP) $(UPGRADE) $(CONSTRAINTS) --no-build-isolation 'deepspeed>=0.16' $(TORCH)
	bash slurm/install.sh

train: setup
	$(PYTHON) -m moetron train configs/tiny.yaml

# The Slurm tests start the local Slurm themselves; it is stopped again when pytest ends, unless it ran
# before (slurm/run_then_stop.sh). The recipe's exit status is pytest's.
test: setup-test
	bash slurm/run_then_stop.sh $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

stop:
	bash slurm/stop.sh

test-latest:
	$(MAKE) test CONSTRAINTS= UPGRADE=--upgrade

constraints:
	$(PYTHON) .ci/freeze.py > constraints.txt

# The torchao the suite passed with; a GPU machine whose torch is older may need an older one
# (make gpu-wheels TORCHAO=torchao==0.15.0).
TORCHAO ?= $(shell grep '^torchao==' constraints.txt)

gpu-wheels: $(VENV)/bin/pip
	rm -rf bench/wheels
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --dest bench/wheels '$(TORCHAO)'
