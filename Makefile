# Two commands on a fresh machine: `make run` (the embedded default) and `make test`.
# Both create the virtual environment first if it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A CPU build of torch lies on local disk on our machines; other versions pull a CUDA build (GBs).
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: run test test-integration test-slow test-all lint bench mutate dry-run lock clean

# constraints.txt: the exact versions of everything else (`make lock` writes it anew), so that a package index
# publishing a new release cannot change what a fresh clone installs.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

run: $(VENV)/.installed          ## train the embedded default (tiny model, built-in task, CPU)
	$(PY) run.py $(ARGS)

dry-run: $(VENV)/.installed      ## validate and print the resource plan
	$(PY) run.py dry_run=true $(ARGS)

test: $(VENV)/.installed         ## the unit tier: no Ray, no subprocess, plus one short real learning run
	$(PY) -m pytest -q -m "not integration and not slow" $(ARGS)

test-integration: $(VENV)/.installed  ## Ray, engines, run.py, sweeps, healing
	$(PY) -m pytest -q -m "integration and not slow" $(ARGS)

test-slow: $(VENV)/.installed    ## the long end-to-end runs
	$(PY) -m pytest -q -m slow $(ARGS)

test-all: $(VENV)/.installed     ## everything
	$(PY) -m pytest -q $(ARGS)

lint: $(VENV)/.installed         ## ruff (rules in pyproject.toml; ruff comes with the dev extra)
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed        ## a bench scenario: NAME=... (default algorithms; python bench/run.py --list)
	$(PY) bench/run.py $(or $(NAME),algorithms) $(ARGS)

mutate: $(VENV)/.installed       ## mutation testing: tests/mutation/mutations.yaml one at a time, lists the survivors
	$(PY) tests/mutation/mutate.py $(ARGS)

.PHONY: docs describe
docs: $(VENV)/.installed         ## draw the figures of docs/architecture.md into docs/img (docs/diagrams.py)
	$(PY) docs/diagrams.py

describe: $(VENV)/.installed     ## every config key: type, value, description (ARGS="rollout model=qwen3_4b")
	$(PY) -m slime_hydra.config describe $(ARGS)

lock:                            ## resolve pyproject.toml (.[dev], with the extras dev names) afresh; write constraints.txt
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python -m pip install -q $(TORCH)
	.lock-venv/bin/python -m pip install -q -e ".[dev]"
	{ sed -n '/^#/p' constraints.txt; .lock-venv/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } \
	  > constraints.txt.tmp && mv constraints.txt.tmp constraints.txt
	rm -rf .lock-venv

clean:
	rm -rf outputs multirun .pytest_cache
