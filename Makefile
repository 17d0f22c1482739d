# Every target creates or updates the virtual environment in .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.twobp-installed
# The CPU build of torch that the dev/test install pins.
TORCH  := torch==2.13.0
# Test processes: each takes whole files (their shared sessions stay in one process).
# Most tests wait on ranks, rendezvous and time-outs as much as they compute, so two
# of them share two cores well. JOBS=0 runs the suite in this one process.
JOBS   ?= 2

.PHONY: run test lint venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]' $(TORCH)
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/twobp train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
