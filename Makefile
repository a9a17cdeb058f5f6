# Two commands:  make lab  (JupyterLab on the start page)   make test  (unit tests + nbval, smoke profile)
PYTHON      ?= python3
VENV        ?= .venv
CONSTRAINTS ?= constraints.txt
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip install -q --disable-pip-version-check -c $(CONSTRAINTS)
NBVAL_CELL_S ?= 300
NBVAL_FLAGS = --nbval-lax --nbval-current-env --nbval-cell-timeout=$(NBVAL_CELL_S) --nbval-sanitize-with tests/sanitize.cfg

.PHONY: lab hub hub-proxy test test-extended unit check lint format notebooks notebooks-cpu site site-check standins labs check-labs release bench grade gradescope two-node clean help slurm-check tensorboard

help:
	@echo "make lab    create .venv if missing, install, start JupyterLab on the repository, open notebooks/00_environment.ipynb"
	@echo "            LAB_ARGS='--no-browser --port 8888 --ip 127.0.0.1' passes options to jupyter lab (see README: SSH tunnel)"
	@echo "make test   unit tests and nbval over notebooks/ and solutions/ (LAB_PROFILE=smoke)"
	@echo "make test-extended  the lab self-checks through each named mistake, hang and deadlock (minutes; CI runs it)"
	@echo "make check  the fast loop: lint, then the tests not marked slow/sandbox/slurm/notebook/extended (minutes)"
	@echo "make lint   ruff check and ruff format --check over every .py and notebook;  make format  fixes"
	@echo "make labs   regenerate labs/*.ipynb from solutions/*.ipynb"
	@echo "make release DEST=dir  what students get: labs, notebooks, library; no solutions/, no tests/"
	@echo "make hub   the class's JupyterHub (cluster/hub/jupyterhub_config.py), run as root from a release folder;"
	@echo "            HUB_GPU_POOL=0,1,2,3 HUB_PER_GPU=1 HUB_CULL_IDLE_S=3600 ... (see the config), HUB_ARGS='--port 8000' to jupyterhub"
	@echo "make standins  write synthetic stand-ins for Fashion-MNIST, CIFAR-10 and Tiny Shakespeare (used only with LAB_DATA=standin)"
	@echo "make notebooks-cpu  every notebook and solution in the cpu profile on the stand-ins"
	@echo "make site  the course as a static site in build/site: every demo executed (cpu profile, stand-ins), the newest"
	@echo "            GPU run of docs/gpu-runs/, the labs as students get them; offline. SITE_ARGS='--profile smoke --only 00_,01_'"
	@echo "make site-check  open build/site in headless Chromium (chromium, chromium-driver) and check every page"
	@echo "make bench  run benchmarks/ (prints figures; never pass/fail)"
	@echo "make slurm-check  start a local one-node SLURM (root), run every cluster/ job template, stop it"
	@echo "make tensorboard  serve runs/profiles (installs the optional tensorboard + torch-tb-profiler)"
	@echo "make gpu-check OUT=dir  prove a GPU server ready, riskiest first (multi-rank DDP, lab rank checks, notebooks 05/03, AMP, monitor, grader, benchmarks, notebooks);"
	@echo "            exit 1 = a check failed, 3 = something not verified. In 9-minute parts: GPU_CHECK_ARGS='--plan 3', then"
	@echo "            GPU_CHECK_ARGS='--part 1/3' (2/3, 3/3), then GPU_CHECK_ARGS=--merge. Also --budget-s, --offline, --accept-incomplete (--help)"
	@echo "make grade SUB=file.py [SPEC=...]  grade one assessment submission (exit 0 = graded, see its status)"
	@echo "make gradescope [SPEC=...]  build the Gradescope autograder zip in build/"
	@echo "make two-node [TWO_NODE_ARGS=...]  the DDP worker as two torchrun 'nodes' on 127.0.0.1 (c10d rendezvous)"

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-lab: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP) -e '.[test,hub]'
	@touch $@ $(VENV)/.installed-lab $(VENV)/.installed-hub

# The class's JupyterHub (cluster/hub/jupyterhub_config.py; README, "Run a class on one GPU server"):
# the [hub] extras in .venv, its proxy from npm into .venv/hub-proxy (no global install), then the hub.
# Settings are HUB_* variables (make hub HUB_GPU_POOL=0,1); HUB_ARGS go to jupyterhub (--port 8000).
HUB_ARGS  ?=
HUB_PROXY := $(VENV)/hub-proxy/node_modules/.bin/configurable-http-proxy
$(VENV)/.installed-hub: pyproject.toml $(CONSTRAINTS) | $(VENV)/.installed-lab
	$(PIP) -e '.[hub]'
	@touch $@

# 5.2.0: the newest release whose dependencies all run on node 20 (5.3.0 wants node 22.12 for commander 15)
$(HUB_PROXY): | $(PY)
	npm install --prefix $(VENV)/hub-proxy --no-fund --no-audit configurable-http-proxy@5.2.0

hub-proxy: $(HUB_PROXY)

hub: $(VENV)/.installed-hub $(HUB_PROXY)
	$(VENV)/bin/jupyterhub -f cluster/hub/jupyterhub_config.py $(HUB_ARGS)

# JupyterLab serves the repository root (notebooks/, labs/, solutions/) and opens the start page.
# As root (containers, cloud images) Jupyter refuses to start without --allow-root: pass it then.
# The news popup is off through the venv's own page_config (no write to ~/.jupyter).
LAB_ARGS  ?=
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
LAB_PAGE_CONFIG := $(VENV)/etc/jupyter/labconfig/page_config.json
$(LAB_PAGE_CONFIG): | $(VENV)/.installed-lab
	$(VENV)/bin/jupyter labextension disable --level=sys_prefix "@jupyterlab/apputils-extension:announcements"

lab: $(VENV)/.installed-lab $(LAB_PAGE_CONFIG)
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir=. $(LAB_ARGS) notebooks/00_environment.ipynb

# Test files run on TEST_JOBS pytest-xdist workers, a whole file (or notebook) per worker, in order:
# most tests wait on processes they start, so two workers fit two cores. TEST_JOBS=1: one process.
TEST_JOBS ?= 2
XDIST      = $(if $(filter-out 0 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile)
# torch's threads in each worker and its notebook kernels: the cores shared out among the workers. Threads
# of two workers on the same cores wait on each other at every parallel region: on 2 busy cores one epoch
# of lab 1's CNN took 7.3 s with 2 threads and 1.5 s with 1 (0.5 s on idle cores).
TEST_THREADS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); j=$(TEST_JOBS); [ "$$j" -gt 1 ] 2>/dev/null || j=1; echo $$(( n / j > 0 ? n / j : 1 )))

# One pytest run: unit tests, then every notebook in notebooks/ and solutions/ under nbval (the site's tests
# need a built site and a browser: make site-check).
test: $(VENV)/.installed-test
	LAB_PROFILE=smoke OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=10 -m "not extended and not site" tests notebooks solutions $(NBVAL_FLAGS)

# The lab self-checks driven through every named mistake, hang and deadlock on real processes (CI runs it).
test-extended: $(VENV)/.installed-test
	LAB_PROFILE=smoke OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=10 -m extended tests

# The contributor's loop: lint and the unit/oracle tests, no notebooks, no sandbox, no SLURM.
check: lint
	LAB_PROFILE=smoke OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests -m "not slow and not sandbox and not slurm and not notebook and not extended"

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

unit: $(VENV)/.installed-test
	LAB_PROFILE=smoke $(PY) -m pytest -q -p no:cacheprovider tests

notebooks: $(VENV)/.installed-test
	LAB_PROFILE=smoke $(PY) -m pytest -q -p no:cacheprovider notebooks solutions $(NBVAL_FLAGS)

# Synthetic look-alikes of Fashion-MNIST, CIFAR-10 and Tiny Shakespeare (real sizes and file formats) for machines
# without the internet, in DATA_DIR/standin/ (default ~/.cache/scaling-labs); only LAB_DATA=standin
# makes anything read them.
standins: $(VENV)/.installed-lab
	$(PY) -m utils.data standins

# The laptop profile end to end: every notebook and solution, cpu sizes, on the stand-ins.
# A cell may take 900 s here, not 300 (nbval's and pytest-timeout's limit): notebook 01's rate tuning takes about
# 2 minutes on 2 idle cores, and more than 300 s beside make test.
NOTEBOOK_DIRS ?= notebooks solutions
notebooks-cpu: NBVAL_CELL_S = 900
notebooks-cpu: $(VENV)/.installed-test standins
	LAB_PROFILE=cpu LAB_DATA=standin $(PY) -m pytest -q -p no:cacheprovider --durations=0 --durations-min=1 $(NOTEBOOK_DIRS) $(NBVAL_FLAGS) --timeout=$(NBVAL_CELL_S)

# The course as a static site (utils/site.py): each demo executed in a fresh kernel (cpu profile, stand-ins), the
# newest GPU run kept in docs/gpu-runs/, the labs as students get them, a front page; built beside build/site and
# renamed into place. Then the same site opened in headless Chromium, every page (tests/test_site.py).
SITE_ARGS ?=
site: $(VENV)/.installed-test standins
	$(PY) -m utils.site build --out build/site $(SITE_ARGS)

site-check: $(VENV)/.installed-test
	$(PY) -m utils.site check build/site
	SITE_DIR=build/site LAB_PROFILE=smoke $(PY) -m pytest -q -p no:cacheprovider -rs -m site tests/test_site.py

labs: $(VENV)/.installed-lab
	$(PY) -m utils.authoring

# What students get: no solutions/, no tests/ (utils/authoring.py, release).
release: $(VENV)/.installed-lab
	@test -n "$(DEST)" || { echo "usage: make release DEST=new-folder"; exit 2; }
	$(PY) -m utils.authoring --release "$(DEST)"

check-labs: $(VENV)/.installed-lab
	$(PY) -m utils.authoring --check

bench: $(VENV)/.installed-lab
	$(PY) benchmarks/train_loop_overhead.py
	$(PY) benchmarks/gpt_step.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/optimizer_step.py
	$(PY) benchmarks/launch_startup.py

SPEC ?= labs/assessment/spec_ci.toml
grade: $(VENV)/.installed-lab
	@test -n "$(SUB)" || { echo "usage: make grade SUB=path/to/submission.py [SPEC=$(SPEC)]"; exit 2; }
	$(PY) -m utils.grader run $(SUB) --spec $(SPEC)

# A one-node SLURM on this machine runs every cluster/*.sbatch template (needs root and slurm-wlm;
# exit 77 = cannot run here, printed and not an error).
slurm-check: $(VENV)/.installed-test
	$(PY) cluster/slurm_check.py || test $$? -eq 77

# Optional viewer for the profiler traces (torch-tb-profiler's last release is 0.4.3, Oct 2023).
$(VENV)/.installed-profile: pyproject.toml | $(VENV)/.installed-lab
	$(PIP) -e '.[profile]'
	@touch $@

tensorboard: $(VENV)/.installed-profile
	$(VENV)/bin/tensorboard --logdir runs/profiles

# The pre-class check of a server (utils/gpucheck.py): OUT/report.json, executed notebooks in OUT/.
# Uses .venv when there is one, else python3 from the PATH when it has PyTorch (a server's own),
# else makes .venv first (as make test does); .site, where the Jupyter wheels go on a server
# without Jupyter, is put on the path. Exit status 1 on a failure. It stops starting checks after
# its budget (500 s) and skips the rest with the reason; GPU_CHECK_ARGS='--budget-s 300 --offline'.
.PHONY: gpu-check
OUT    ?= gpu-check
GPU_CHECK_ARGS ?=
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(if $(shell python3 -c 'import torch' 2>/dev/null && echo y),python3,$(PY)))
gpu-check: $(if $(filter $(PY),$(GPU_PY)),$(VENV)/.installed-test)
	PYTHONPATH="$(CURDIR)/.site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PY) -m utils.gpucheck --out "$(OUT)" $(GPU_CHECK_ARGS)
# A failing grade is a result (printed, exit 0), not a make error; `run --strict` exits 1 for it.
gradescope: $(VENV)/.installed-lab
	$(PY) -m utils.grader zip --spec $(SPEC) --out build/gradescope-autograder.zip

# The DDP worker as two torchrun "nodes" on this machine, as two real nodes would run it: the same
# command on each node, the same --rdzv-id and --rdzv-endpoint (a host:port of the first node);
# c10d rendezvous assigns node ranks itself (no --node-rank). TWO_NODE_ARGS go to utils.ddp_train.
TWO_NODE_PORT ?= 29400
TWO_NODE_ARGS ?= --epochs 2
TORCHRUN_2N    = $(VENV)/bin/torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
                 --rdzv-endpoint 127.0.0.1:$(TWO_NODE_PORT) --rdzv-id two-node-$(TWO_NODE_PORT) -m utils.ddp_train $(TWO_NODE_ARGS)
two-node: $(VENV)/.installed-lab
	$(TORCHRUN_2N) & first=$$!; $(TORCHRUN_2N); second=$$?; wait $$first && exit $$second

clean:
	rm -rf $(VENV) .pytest_cache
