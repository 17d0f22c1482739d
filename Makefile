# Every target creates or updates the virtual environment in .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.twobp-installed
# The CPU build of torch that the dev/test install pins.
TORCH  := torch==2.13.0

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
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
