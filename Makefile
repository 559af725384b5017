# Set-up and the two jobs of the README. The venv is built once (a stamp file marks it done)
# and rebuilt when pyproject.toml changes.
#
#   make train   install, then train the default model (shoal train)
#   make lint    install, then check the code: ruff (style, imports, likely bugs), mypy (types) and
#                lint-imports (the layers: import-linter contracts), all reading pyproject.toml; and
#                tools/check-comments (no dates in src/ comments: measurements live in docs/)
#   make test    install, then run the test suite, less the sweeps marked slow
#   make test-slow  the sweeps marked slow (many plans or CLI runs each; run before a release), then the
#                   mutation bench (bench/mutations.py: planted bugs, each caught by its tests)
#
# torch is installed first, on its own, so that pip takes the CPU build named here and the
# package's `torch` range is already satisfied (pip never pulls a CUDA build on a CPU machine).
# Elsewhere, point pip at PyTorch's CPU index: make test TORCH_PIP_FLAGS="--index-url https://download.pytorch.org/whl/cpu"
# After shoal, tools/fetch-jemalloc puts Debian's libjemalloc2 in the venv where apt can fetch it: shoal's CPU workers
# preload it (src/shoal/infra/host_memory.py); without it they run on glibc's malloc.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_PIP_FLAGS ?=
STAMP := $(VENV)/.shoal-installed
RUN_ENV := OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1

.PHONY: setup train lint test test-slow clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(TORCH_PIP_FLAGS) $(TORCH) numpy
	$(VENV)/bin/pip install -e ".[dev]"
	tools/fetch-jemalloc $(VENV)
	touch $(STAMP)

train: $(STAMP)
	$(RUN_ENV) $(VENV)/bin/shoal train

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python tools/check-comments

test: $(STAMP)
	$(RUN_ENV) $(VENV)/bin/python -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	$(RUN_ENV) $(VENV)/bin/python -m pytest -q -m slow tests
	$(RUN_ENV) $(VENV)/bin/python -m bench.mutations

clean-venv:
	rm -rf $(VENV)
