# rlrec: set-up and everyday targets.  Every target installs .venv first if needed;
# a stamp named after the hash of pyproject.toml and setup.py makes later
# runs skip installation entirely (no pip call) until one of them changes.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# torch first and pinned: a CPU wheel of this version lies on disk on our
# machines; an unpinned torch would download GBs of CUDA packages.
TORCH_VERSION ?= 2.13.0
# setup.py is part of the install: a change to it reinstalls
PYPROJECT_HASH := $(shell cat pyproject.toml setup.py | sha256sum | cut -c1-12)
STAMP := $(VENV)/.stamp-$(PYPROJECT_HASH)
PYTEST_ARGS ?=

.PHONY: venv test test-fast lint format demo bench

venv: $(STAMP)

$(STAMP): | $(VENV)/bin/python
	$(VPY) -m pip install torch==$(TORCH_VERSION)
	$(VPY) -m pip install -e '.[all]'
	@rm -f $(VENV)/.stamp-*
	@touch $@

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

test: venv
	$(VPY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(VPY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# ruff, configured in pyproject.toml (CI runs `lint` before the tests; `format` rewrites files)
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The closed loop on this machine (DEMO_ARGS, e.g. DEMO_ARGS="--s3 --duration 300").
DEMO_ARGS ?=
demo: venv
	$(VENV)/bin/rlrec demo $(DEMO_ARGS)

bench: venv
	$(VPY) bench/run.py
