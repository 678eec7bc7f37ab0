# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export OMP_NUM_THREADS := 1

.PHONY: venv demo test test-slurm clean

$(BIN)/.ready: setup.py Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel setuptools
	# torch first: the CPU wheel on this machine; GPU clusters bring their own torch.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[deepspeed,parity,plot,test]'
	touch $@

venv: $(BIN)/.ready

demo: venv
	$(BIN)/shardsafe demo

test: venv
	$(BIN)/python -m pytest -q tests

test-slurm: venv
	$(BIN)/python -m pytest -q tests/slurm

clean:
	rm -rf $(VENV) build *.egg-info
