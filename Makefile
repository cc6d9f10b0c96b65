# One virtual environment for everything; override TORCH_SPEC for a CUDA build, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-frameworks lint demo bench perf cov clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -n 2 -q -m "not frameworks" tests

# The third-party frameworks' runs on simulated GPUs (Lightning, DeepSpeed, torchtitan): slow, CI's second step.
test-frameworks: install
	$(PY) -m pytest -n 2 -q -m frameworks tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: install
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
