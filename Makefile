# The two set-up commands of the README: `make demo` and `make test`. Both build the virtual
# environment in .venv first, so a fresh machine needs nothing but Python 3.10+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_BASE := $(VENV)/.installed-base
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP_BASE): $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(STAMP_TEST): $(STAMP_BASE)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

venv: $(STAMP_BASE)

demo: $(STAMP_BASE)
	$(BIN)/python examples/imperative_allreduce.py
	$(BIN)/python -m ray_collective.sim --collective allreduce --ranks 4096 --bytes 1048576

test: $(STAMP_TEST)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
