PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test test-all test-fast lint demo bench lock

# constraints.txt pins the whole environment (runtime, test and lint tools) to exact versions.
install:
	$(PIP) install -q -c constraints.txt -e ".[dev]"

lint:
	$(PYTHON) -m ruff check canzona sim reference cli tests benchmarks examples notebooks

# The tests without spawned ranks and the notebooks run on every core, in one pool (the notebooks
# first: the longest items, so none is left for last). The spawned gloo groups two test files at a
# time, each file on one worker (the spawned runs it caches for its tests are made once: `--dist
# loadfile`); their ranks meet on ports a listening socket holds (tests/launchers.py: no free port
# picked, closed and handed over, which the other worker's ranks could take first); their
# wall-clock checks pass beside two busy-looping processes, a heavier load than the other worker's.
# `slow`: larger variants of checks made already. `--durations`: the slowest items, for keeping CI short.
test: install lint
	$(PYTHON) -m pytest -m "not distributed and not slow" -n auto --durations=15 --nbmake notebooks tests
	$(PYTHON) -m pytest -m "distributed and not slow" -n 2 --dist loadfile --durations=15

# Everything, the slow variants included.
test-all: install lint
	$(PYTHON) -m pytest
	$(PYTHON) -m pytest --nbmake notebooks

# The policy-core, simulator and CLI tests only (no spawned gloo ranks, no notebooks, no slow
# variants), on every core: make test's first pool without the notebooks.
test-fast: install
	$(PYTHON) -m pytest -m "not distributed and not slow" -n auto

demo: install
	$(PYTHON) -m cli.main compare

bench: install
	$(PYTHON) benchmarks/bench_plan.py
	$(PYTHON) benchmarks/bench_sim.py

# Re-resolve constraints.txt in a fresh virtual environment (today's releases, torch held at 2.13.0).
lock:
	venv=$$(mktemp -d /tmp/canzona-lock.XXXXXX) && trap 'rm -rf "$$venv"' EXIT && \
	$(PYTHON) -m venv "$$venv" && "$$venv/bin/pip" install -q torch==2.13.0 -e ".[dev]" && \
	{ sed -n '/^#/p' constraints.txt; \
	  "$$venv/bin/pip" freeze --exclude-editable | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > constraints.txt.new && \
	mv constraints.txt.new constraints.txt
