# Every target bootstraps .venv itself: a fresh Debian machine with Python >= 3.11 needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
# The hot modules of the core compiled with mypyc (setup.py), rebuilt when any core source changes.
# SEQSTATE_PURE=0: a compile that fails stops here; setup.py would otherwise fall back to the
# pure core, and `make test` would test it twice under the name of the compiled one.
NATIVE := seqstate/.native-built
CORE_SRC := $(wildcard seqstate/*.py)

.PHONY: test test-dynamo dynamo-demo run bench lint native pure clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	SEQSTATE_PURE=1 $(BIN)/python -m pip install --quiet -e '.[test,fast]'
	touch $(STAMP)

$(NATIVE): $(STAMP) setup.py $(CORE_SRC)
	SEQSTATE_PURE=0 $(BIN)/python setup.py --quiet build_ext --inplace --force
	touch $(NATIVE)

native: $(NATIVE)

# The optional `bench` extra (scale.py's plot, http_servers.py's candidates); not a test dependency.
$(BENCH_STAMP): $(STAMP)
	SEQSTATE_PURE=1 $(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

pure:
	rm -f seqstate/*.so $(NATIVE)

# ruff's lint and format, mypy, and the import contracts of pyproject.toml (the wings' layering).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# examples/js's packages (the official NATS JavaScript client), from its committed lock file:
# tests/integration/test_js_reader.py runs its reader and publisher against a real pipeline.
# npm writes node_modules/.package-lock.json on every install: the stamp.
JS_STAMP := examples/js/node_modules/.package-lock.json

$(JS_STAMP): examples/js/package-lock.json
	npm ci --prefix examples/js --no-audit --no-fund
	touch $(JS_STAMP)

# Two passes. The whole suite against the compiled core; then the tests marked `core` (those
# that exercise seqstate/ itself, with no nats-server: its unit, reference, property and
# conformance tests) against the pure sources, the reference the compiled build must equal.
# Only the core differs between the builds, and the core tests cover it in seconds; running the
# integration and fault tests a second time cost minutes and tested the same projector/ again.
# etcd (for Dynamo's etcd discovery) is unpacked from Debian's package into a cache outside the
# checkout by tests/tools/install_etcd.sh: at once when already there.
test: $(NATIVE) $(JS_STAMP) lint
	bash tests/tools/install_etcd.sh >/dev/null
	bash tests/tools/install_debian_tools.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest
	SEQSTATE_PURE=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -m core

# The live suite against a real Dynamo 1.6.1 fleet (tests/dynamo, README.md there). Dynamo is
# never a dependency of seqstate: its venv is built once by deploy/dynamo/install_dynamo.sh,
# outside the checkout (DYNAMO_VENV overrides where), and reused while it imports.
# Fleets on etcd discovery take Debian's etcd-server, unpacked once into ETCD_DIR.
# `make test` deselects these tests; only `-m dynamo` runs them.
DYNAMO_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/seqstate/dynamo-1.6.1
ETCD_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/seqstate/etcd-3.4

test-dynamo: $(NATIVE)
	bash deploy/dynamo/install_dynamo.sh "$(DYNAMO_VENV)"
	etcd="$$(bash tests/tools/install_etcd.sh "$(ETCD_DIR)")" && ETCD_BIN="$$etcd" DYNAMO_VENV="$(DYNAMO_VENV)" PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -m dynamo tests/dynamo

# A CPU Dynamo fleet (nats-server with JetStream, two mockers, two KV-router frontends with
# replica sync) with seqstate following it, a chat load and `seqstate top`; Ctrl-C stops it
# all (docs/dynamo.md). DISCOVERY=etcd puts the fleet on an etcd of its own instead of files.
DISCOVERY ?= file

dynamo-demo: $(NATIVE)
	bash deploy/dynamo/install_dynamo.sh "$(DYNAMO_VENV)"
	$(if $(filter etcd,$(DISCOVERY)),ETCD_BIN="$$(bash tests/tools/install_etcd.sh "$(ETCD_DIR)")" )PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m projector.dynamo.demo --dynamo-venv "$(DYNAMO_VENV)" --discovery "$(DISCOVERY)"

# The demo, its server on nats://127.0.0.1:4222; refused if that port is taken (Dynamo's NATS
# listens there too): SEQSTATE_PORT=0 make run takes any free one, and the log names it.
# It replays the sample the repo ships (the Mooncake trace's first 1,000 requests, data/README.md);
# `seqstate run --demo --trace data/mooncake_conversation_trace.jsonl` replays the whole trace.
run: $(NATIVE)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/seqstate run --demo --trace data/mooncake_sample.jsonl

bench: $(NATIVE) $(BENCH_STAMP)
	$(BIN)/python benchmarks/fold.py

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis .ruff_cache .mypy_cache seqstate/*.so $(NATIVE)
