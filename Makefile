# Two commands:  make lab  (JupyterLab on the start page)   make test  (unit tests + nbval, smoke profile)
PYTHON      ?= python3
VENV        ?= .venv
CONSTRAINTS ?= constraints.txt
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip install -q --disable-pip-version-check -c $(CONSTRAINTS)
NBVAL_FLAGS := --nbval-lax --nbval-current-env --nbval-cell-timeout=300 --nbval-sanitize-with tests/sanitize.cfg

.PHONY: lab test unit notebooks labs check-labs bench grade clean help

help:
	@echo "make lab    create .venv if missing, install, start JupyterLab on notebooks/00_environment.ipynb"
	@echo "make test   unit tests and nbval over notebooks/ and solutions/ (LAB_PROFILE=smoke)"
	@echo "make labs   regenerate labs/*.ipynb from solutions/*.ipynb"
	@echo "make bench  run benchmarks/ (prints figures; never pass/fail)"
	@echo "make grade SUB=file.py [SPEC=...]  grade one assessment submission"

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-lab: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP) -e '.[test]'
	@touch $@ $(VENV)/.installed-lab

lab: $(VENV)/.installed-lab
	$(VENV)/bin/jupyter lab notebooks/00_environment.ipynb

# One pytest run: unit tests, then every notebook in notebooks/ and solutions/ under nbval.
test: $(VENV)/.installed-test
	LAB_PROFILE=smoke $(PY) -m pytest -q -p no:cacheprovider tests notebooks solutions $(NBVAL_FLAGS)

unit: $(VENV)/.installed-test
	LAB_PROFILE=smoke $(PY) -m pytest -q -p no:cacheprovider tests

notebooks: $(VENV)/.installed-test
	LAB_PROFILE=smoke $(PY) -m pytest -q -p no:cacheprovider notebooks solutions $(NBVAL_FLAGS)

labs: $(VENV)/.installed-lab
	$(PY) -m utils.authoring

check-labs: $(VENV)/.installed-lab
	$(PY) -m utils.authoring --check

bench: $(VENV)/.installed-lab
	$(PY) benchmarks/train_loop_overhead.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/optimizer_step.py

SPEC ?= labs/assessment/spec_ci.toml
grade: $(VENV)/.installed-lab
	@test -n "$(SUB)" || { echo "usage: make grade SUB=path/to/submission.py [SPEC=$(SPEC)]"; exit 2; }
	$(PY) -m utils.grader run $(SUB) --spec $(SPEC)

clean:
	rm -rf $(VENV) .pytest_cache
