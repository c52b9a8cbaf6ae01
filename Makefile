PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test lint demo bench

install:
	$(PIP) install -q -c constraints.txt -e ".[dev]"

lint:
	$(PYTHON) -m ruff check canzona sim reference cli tests benchmarks

test: install lint
	$(PYTHON) -m pytest
	$(PYTHON) -m pytest --nbmake notebooks

demo: install
	canzona compare

bench: install
	$(PYTHON) benchmarks/bench_plan.py
	$(PYTHON) benchmarks/bench_sim.py
