# One virtual environment for everything; override TORCH_SPEC for a CUDA build, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-frameworks test-torch lint demo bench perf cov clean

install: $(STAMP)

# The project and its test tools go in with torch held at what TORCH_SPEC installed: a test
# tool pinning something that torch build does not match fails the install instead of
# swapping torch for another build.
$(STAMP): pyproject.toml setup.py accel_simulate.pth Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip freeze | grep -E '^torch( @|==)' > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[test]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -n 2 -q -m "not frameworks and not processes" tests

# The third-party frameworks' runs on simulated GPUs (Lightning, DeepSpeed, torchtitan, Accelerate, the Trainer) and the tests that start
# whole processes as a user would (simulated nodes, torchrun, pytest sessions): slow, CI's second step.
test-frameworks: install
	$(PY) -m pytest -n 2 -q -m "frameworks or processes" tests

# The simulator's tests (tests/multiproc and tests/test_sim_*.py, frameworks left out) on another
# torch, in a venv of its own; CI runs it on torch 2.14.1, a CUDA build:
#   make test-torch TORCH_SPEC="torch==2.14.1" VENV=.venv-2.14
# It stops first if VENV holds another torch than TORCH_SPEC names (a venv made for another one).
WANTED_TORCH := $(patsubst torch==%,%,$(filter torch==%,$(TORCH_SPEC)))
SIM_TESTS := tests/multiproc $(sort $(wildcard tests/test_sim_*.py))
ifneq ($(filter test-torch,$(MAKECMDGOALS)),)
ifeq ($(VENV)$(TORCH_SPEC),.venvtorch==2.13.0)
else ifeq ($(VENV),.venv)
$(error .venv is make test's, with torch 2.13.0: give TORCH_SPEC="$(TORCH_SPEC)" a venv of its own, e.g. VENV=.venv-$(WANTED_TORCH))
endif
endif

test-torch: install
	$(PY) -c 'import torch; print("torch", torch.__version__, "(CUDA", torch.version.cuda, "build)" if torch.version.cuda else "(CPU build)", "in $(VENV)")'
	@test -z "$(WANTED_TORCH)" || $(PY) -c 'import sys, torch; have = torch.__version__.split("+")[0]; \
	sys.exit(0 if have == "$(WANTED_TORCH)" else f"$(VENV) holds torch {have}, not $(WANTED_TORCH): give that torch a venv of its own (VENV=.venv-$(WANTED_TORCH))")'
	$(PY) -m pytest -n 2 -q -m "not frameworks" $(SIM_TESTS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The demo needs torch and the project only, not the test tools (frameworks, linters).
$(VENV)/.demo-installed: pyproject.toml setup.py accel_simulate.pth Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e .
	touch $@

demo: $(VENV)/.demo-installed
	$(VENV)/bin/accel launch --simulate cuda --num_processes 4 examples/train_regression.py

bench: install
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# A quick look at the library's cost over hand-written loops (issue 19's floors: training
# step <= 1.03x, prepared loader <= 1.05x): both benchmarks, short, on 2 CPU and 2 simulated
# GPU ranks; prints the median ratios. Timings only, never a pass/fail: run it before and
# after a change to the hot path and compare (the full runs are the benchmarks' defaults).
perf: install
	$(PY) benchmarks/bench_training.py --launches 2 --rounds 8 --steps 30
	$(PY) benchmarks/bench_data_loader.py --launches 2 --rounds 8

cov: install
	$(PY) -m pytest -n 2 -q --cov=accel --cov=harness --cov-report=term-missing tests

clean:
	rm -rf $(VENV) .coverage .coverage.* htmlcov
