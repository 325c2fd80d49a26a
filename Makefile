# Two entry points for a fresh machine: `make example` and `make test`. Both set up .venv first.
PYTHON ?= python3
# Pinned: on these machines pip takes this CPU wheel from local disk, while an unpinned torch resolves to a
# CUDA build of several GB. Elsewhere: make TORCH="torch==2.13.0 --index-url <PyTorch's CPU wheel index>".
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: example test bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

example: $(STAMP)
	$(BIN)/python example.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs

bench: $(STAMP)
	$(BIN)/python bench.py --compare-hf
