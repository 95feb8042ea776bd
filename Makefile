# Every target bootstraps .venv itself: a fresh Debian machine with Python >= 3.11 needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

run: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/seqstate run --demo

bench: $(STAMP)
	$(BIN)/python benchmarks/fold.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
