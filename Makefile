# Set-up steps are file targets, so running `make demo` or `make test` again skips them.
VENV ?= .venv
PY := $(VENV)/bin/python
FMNIST_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup data demo test golden bench bench-scale bench-phases lint clean

setup: $(VENV)/.installed data

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, pinned, so that the project's range (torch>=2.3,<3) is already met and pip
# never fetches a multi-GB CUDA build. constraints.txt pins torch and numpy to the versions
# the golden fixtures were written with (tests/golden).
$(VENV)/.torch: constraints.txt | $(PY)
	$(PY) -m pip install -q -c constraints.txt torch
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt $(VENV)/.torch
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,flower,ray,tensorboard]'
	touch $@

# The Fashion-MNIST Debian package, where apt is usable; otherwise say how to get the data.
data:
	@if [ -f $(FMNIST_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
		|| echo "warning: could not install dataset-fashion-mnist; see docs/data.md"; \
	elif command -v apt-get >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
		(sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
		|| echo "warning: could not install dataset-fashion-mnist; see docs/data.md"; \
	else \
		echo "note: Fashion-MNIST not installed (no usable apt); set HETFL_DATA, see docs/data.md"; \
	fi

demo: setup
	$(VENV)/bin/hetfl run --overwrite

# Two worker processes (pytest-xdist), each test file on one of them so module fixtures
# are built once: most tests run one single-threaded process, so two share two cores.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

# Rewrite the golden fixtures (tests/golden/*.json), each run twice under different
# PYTHONHASHSEED with the suite's pinned numerics and written only if both agree; then
# measure how far other numerics move them (tests/golden/tolerance.json, the comparison
# where the pins cannot apply). A changed result is a deliberate fixture update, committed
# on its own.
golden: setup
	$(PY) tests/golden/generate.py
	$(PY) tests/golden/measure.py

# Speed and memory against a plain-PyTorch floor (not a test; see benchmarks/README.md).
bench: setup
	$(PY) benchmarks/bench.py

# Peak memory of 10,000 clients with private layers under a store memory budget (not part
# of `bench`; see benchmarks/README.md).
bench-scale: setup
	$(PY) benchmarks/bench_scale.py

# Set-up time against one round, and each phase's share of the cores, of FedFA's shipped
# config (ZiCo cold, then warm) and workload H (issue 48 item 2; not part of `bench`; see
# benchmarks/README.md).
bench-phases: setup
	$(PY) benchmarks/bench_phases.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(VENV)/bin/ruff format --check src tests benchmarks tools
	$(VENV)/bin/mypy src/hetfl benchmarks tools

clean:
	rm -rf $(VENV) runs .pytest_cache
