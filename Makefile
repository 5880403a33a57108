# Two entry points for a fresh machine: `make demo` and `make test` (each sets everything up first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build on the CI machines' disk; on a GPU box, an existing torch in the venv is kept.
INSTALL := torch==2.13.0 transformers==5.17.0 -e .[models,test,ruler,serve]

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(INSTALL)
	touch $@

.PHONY: setup demo test
setup: $(BIN)/.installed

demo: setup
	$(BIN)/nanovllm generate

test: setup
	$(BIN)/python -m pytest -q
