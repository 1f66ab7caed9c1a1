# The commands of the README: `make demo`, `make test` (see CONTRIBUTING.md), `make docs` (the
# documentation site, strict) and `make bench`
# (reruns every table and plot of benchmarks/README.md's results page, both timing modes, about
# an hour; `make bench-nodes` only its part across nodes); `make
# ps-example` (the parameter-server example, one short run of six variants) and `make ps-bench`
# (its whole table: 1000 updates x 3 trials x 1-16 workers x 9 variants, hours on 2 cores).
# Each builds the virtual environment in .venv first, so a fresh machine needs nothing but
# Python 3.10+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_BASE := $(VENV)/.installed-base
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test test-without-ray docs bench bench-nodes bench-400 ps-example ps-bench spacy-bench venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The native core (ray_collective/native/*.c) is built by the same install: a changed source
# reinstalls, which rebuilds it.
NATIVE_SOURCES := $(wildcard ray_collective/native/*.c ray_collective/native/*.h)

$(STAMP_BASE): $(BIN)/python setup.cfg setup.py pyproject.toml $(NATIVE_SOURCES)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(STAMP_TEST): $(STAMP_BASE)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

venv: $(STAMP_BASE)

demo: $(STAMP_BASE)
	$(BIN)/python examples/imperative_allreduce.py
	$(BIN)/python -m ray_collective.sim --collective allreduce --ranks 4096 --bytes 1048576

# The whole suite, every test extra required (a missing one fails the run instead of skipping
# the tests that need it) and the native core too (a missing C extension fails the run,
# tests/test_engines.py, instead of falling back to the pure-Python engine as an installed
# package would); a part of it with, for example, `make test PYTEST_ARGS="-m unit"`.
# pytest's exit status is make's: a run that selects no test (status 5) fails too.
PYTEST_ARGS ?=
test: $(STAMP_TEST)
	RAY_COLLECTIVE_REQUIRE_EXTRAS=1 RAY_COLLECTIVE_REQUIRE_NATIVE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The fast tests with Ray made unimportable (tests/support/without_ray.py): they need none.
test-without-ray: $(STAMP_TEST)
	RAY_COLLECTIVE_REQUIRE_NATIVE=1 $(BIN)/python tests/support/without_ray.py -q -m unit $(PYTEST_ARGS)

# The documentation site (docs/, Sphinx with MyST pages and the API reference from the
# docstrings) into docs/_build/html, every warning an error, as tests/test_docs.py builds it.
STAMP_DOCS := $(VENV)/.installed-docs
$(STAMP_DOCS): $(STAMP_BASE)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(STAMP_DOCS)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

bench: $(STAMP_TEST)
	PYTHON=$(BIN)/python benchmarks/reproduce.sh

bench-nodes: $(STAMP_TEST)
	PYTHON=$(BIN)/python benchmarks/reproduce.sh across-nodes

# benchmarks.scale_real starts its one node without the processes it has no use for and runs the
# ranks' Python with -OO (docs/running-at-scale.md). Its largest group runs in an environment
# of the library and its dependencies alone (.venv-scale: ray and numpy): the test environment's
# other packages cost each rank about 6 MiB more, which 400 ranks on this machine do not have.
SCALE_VENV := .venv-scale
$(SCALE_VENV)/.installed: setup.cfg setup.py pyproject.toml $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(SCALE_VENV)
	$(SCALE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SCALE_VENV)/bin/python -m pip install --quiet .
	touch $@

LARGEST_RANKS ?= 400
bench-400: $(STAMP_TEST) $(SCALE_VENV)/.installed
	flock /tmp/ray_collective_bench.lock $(BIN)/python -m benchmarks.scale_real \
	    --ranks 64,128,256 --json benchmarks/results/scale-real-64-256.json
	flock /tmp/ray_collective_bench.lock $(SCALE_VENV)/bin/python -m benchmarks.scale_real \
	    --ranks $(LARGEST_RANKS) --small --drill \
	    --json benchmarks/results/scale-real-largest.json
	$(BIN)/python -m benchmarks.scale_real --from-json \
	    --json benchmarks/results/scale-real-64-256.json \
	    --json benchmarks/results/scale-real-largest.json \
	    --plot benchmarks/results/plots/scale-real-400.png
	flock /tmp/ray_collective_bench.lock $(BIN)/python -m benchmarks \
	    --collective allreduce,broadcast,allgather,barrier --backends ray,gloo,torch \
	    --world-size 64 --bytes 8,64K,1M --iters 20 --warmup 3 \
	    --json benchmarks/results/scale-gloo-64.json

ps-example: $(STAMP_TEST)
	$(BIN)/python -m examples.parameter_server --workers 4 --steps 100

PS_BENCH_ARGS ?=
ps-bench: $(STAMP_TEST)
	flock /tmp/ray_collective_bench.lock $(BIN)/python -m benchmarks.param_server \
	    --json benchmarks/results/param_server.json --markdown benchmarks/results/param_server.md \
	    --plot benchmarks/results/plots/param_server_throughput.png $(PS_BENCH_ARGS)

# spaCy's tok2vec + ner on 1-16 Ray workers: parameter server, allreduce, reducescatter and
# Gloo's allreduce, 1000 updates x 3 trials (many hours on 2 cores: run it in parts with
# SPACY_BENCH_ARGS="--first-trial 1 --trials 1 --workers 8", then join them with --from-json).
SPACY_BENCH_ARGS ?=
spacy-bench: $(STAMP_TEST)
	flock /tmp/ray_collective_bench.lock $(BIN)/python -m benchmarks.spacy_train \
	    --json benchmarks/results/spacy_train.json --markdown benchmarks/results/spacy_train.md \
	    $(SPACY_BENCH_ARGS)

clean:
	rm -rf $(VENV) $(SCALE_VENV) build *.egg-info .pytest_cache docs/_build
