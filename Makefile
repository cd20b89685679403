# ringpack: `make demo` and `make test` each do all set-up from a fresh clone (venv, install, run).
#
# The venv sees the system's site-packages, so a torch you already have is kept. With no torch,
# the CPU build is installed (the PyTorch CPU index is preferred; pip skips it quickly where
# unreachable) and never a multi-GB CUDA build. Override with TORCH_SPEC / TORCH_INDEX.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: install demo test test-slow test-all clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install -q --retries 0 --extra-index-url $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/ringpack demo

# test: everything but the tests marked slow (process groups, subprocesses, whole doc pages);
# test-slow: those; CI runs both (.ci/run).
test: install
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: install
	$(BIN)/python -m pytest -q -m slow

test-all: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-out .pytest_cache
