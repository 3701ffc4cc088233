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
# the tests not marked `system` run in this many pytest-xdist processes; Ray tests share one
# xdist_group (tests/conftest.py), so --dist loadgroup keeps them on one worker, one Ray at a time
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup

# Azurite (Azure Blob emulator) from npm, for the tests of az:// stores; 3.35.0 is the last
# release that runs on Node 20. Without npm the target says so and those tests skip.
AZURITE_VERSION ?= 3.35.0
AZURITE_STAMP := .emulators/.stamp-azurite-$(AZURITE_VERSION)

.PHONY: venv emulators test test-main test-system test-fast lint format demo bench check-evaluate-extra

venv: $(STAMP)

emulators: $(AZURITE_STAMP)

$(AZURITE_STAMP):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --prefix .emulators --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION) && touch $@; \
	else \
		echo "== npm not found: the tests of az:// stores will skip (install Node.js 20 and npm, then make emulators)"; \
	fi

$(STAMP): | $(VENV)/bin/python
	$(VPY) -m pip install torch==$(TORCH_VERSION)
	$(VPY) -m pip install -e '.[all]'
	@rm -f $(VENV)/.stamp-*
	@touch $@

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The whole suite: the tests not marked `system` in parallel, then the whole-system runs
# (`-m system`: benchmark smoke run, emulated compose, consumer processes killed or scaled out,
# the 100k-episode memory run, Ray cluster and `rlrec train` CLI runs, demo, chaos) in one process.  Each part prints its wall time; the first failure stops.
test: venv emulators
	@$(MAKE) --no-print-directory test-main
	@$(MAKE) --no-print-directory test-system

test-main: venv emulators
	@t0=$$(date +%s); $(VPY) -m pytest -q -m "not system" $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	echo "== tests not marked system ($(XDIST)): $$(( $$(date +%s) - t0 )) s, pytest exit $$rc"; exit $$rc

test-system: venv emulators
	@t0=$$(date +%s); $(VPY) -m pytest -q -m system $(PYTEST_ARGS); rc=$$?; \
	echo "== tests marked system (one process): $$(( $$(date +%s) - t0 )) s, pytest exit $$rc"; exit $$rc

# the quick loop: no slow (and so no system) tests, in parallel
test-fast: venv emulators
	$(VPY) -m pytest -q -m "not slow and not system" $(XDIST) $(PYTEST_ARGS)

# ruff, configured in pyproject.toml (CI runs `lint` before the tests; `format` rewrites files)
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# `rlrec evaluate` with only `rlrec[evaluate]` installed in a fresh venv (no Ray): .ci/check-evaluate-extra
check-evaluate-extra: venv
	PYTHON="$(PYTHON)" TORCH_VERSION="$(TORCH_VERSION)" .ci/check-evaluate-extra

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The closed loop on this machine (DEMO_ARGS, e.g. DEMO_ARGS="--s3 --duration 300").
DEMO_ARGS ?=
demo: venv
	$(VENV)/bin/rlrec demo $(DEMO_ARGS)

bench: venv
	$(VPY) bench/run.py
