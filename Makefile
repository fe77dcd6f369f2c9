# h3gate: two commands on a fresh machine.
#   make demo   install into .venv and run the one-block gate on the embedded default (tiny, CPU when no GPU)
#   make test   install the test extra into .venv and run lint + the whole test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.h3gate-installed
TSTAMP  := $(VENV)/.h3gate-test-installed
# On a machine without an NVIDIA driver pin the CPU wheel of torch first, so that no open range pulls a CUDA build.
TORCH_PIN := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "torch==2.13.0 triton==3.6.0")
PYTEST_ARGS ?= -n 2

.PHONY: install install-test demo test lint format clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH_PIN)" ]; then $(BIN)/python -m pip install -q $(TORCH_PIN); fi
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(TSTAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

install: $(STAMP)
install-test: $(TSTAMP)

demo: $(STAMP)
	$(BIN)/h3gate run ws1-block

lint: $(TSTAMP)
	$(BIN)/ruff check h3gate tests tools
	$(BIN)/ruff format --check h3gate tests tools

format: $(TSTAMP)
	$(BIN)/ruff format h3gate tests tools
	$(BIN)/ruff check --fix h3gate tests tools

test: lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) evidence/local .pytest_cache .ruff_cache .hypothesis
