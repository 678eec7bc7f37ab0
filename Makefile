# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export OMP_NUM_THREADS := 1
# DeepSpeed's JIT-built CPU ops live in the venv (scripts/build_deepspeed_ops.py builds them with it).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: venv venv-packages demo test test-slurm test-mcore019 clean

$(BIN)/.ready: pyproject.toml setup.py Makefile kernels/csrc/copy_hash.c scripts/build_deepspeed_ops.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip wheel setuptools
	# torch first: the CPU wheel on this machine; GPU clusters bring their own torch.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	# DeepSpeed first (the pin from pyproject.toml's deepspeed extra): its three CPU ops then compile in the
	# background on both cores (about two minutes here) while pip installs the rest on one.
	$(BIN)/pip install -q "$$($(BIN)/python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))\
		['project']['optional-dependencies']['deepspeed'][0])")"
	$(BIN)/python scripts/build_deepspeed_ops.py > $(VENV)/build_deepspeed_ops.log 2>&1 & ops=$$!; \
	$(MAKE) --no-print-directory venv-packages; rc=$$?; \
	wait $$ops || echo "make venv: DeepSpeed's CPU ops were not built (below); the first trainer that loads one" \
		"builds it, or fails saying why"; \
	cat $(VENV)/build_deepspeed_ops.log; exit $$rc
	touch $@

venv: $(BIN)/.ready

# The package as pyproject.toml defines it (the same as `pip install shardsafe[...]`), editable: kernels/ is built
# in place, the activation hook (.pth) goes into the venv. `test` brings hf and lightning.
# Megatron-LM's training loop ships from megatron-core 0.17.1, which declares Python >= 3.12 but runs on 3.11:
# a side folder that the Megatron-LM tests and examples put first on PYTHONPATH.
venv-packages:
	$(BIN)/pip install -q -e '.[deepspeed,megatron,parity,plot,test]'
	test -d $(VENV)/mcore-0.17.1/megatron || $(BIN)/pip install -q --no-deps --ignore-requires-python \
		--target $(VENV)/mcore-0.17.1 megatron-core==0.17.1 pyyaml==6.0.4

demo: venv
	$(BIN)/shardsafe demo

# Most of the suite waits (rendezvous, restarts, timeouts): TEST_WORKERS files run side by side, each file on one
# worker (its module fixtures run once), the longest first (tests/conftest.py; --no-loadscope-reorder keeps that
# order). The base folder is short because a holder's socket path lives under a test's tmp_path and Unix sockets
# take at most 107 bytes; it is removed when every test passed.
# The project's own modules are compiled first: where PYTHONDONTWRITEBYTECODE is set, every one of the suite's
# thousand-odd processes (holders, trainers, agents) would compile them from source again.
TEST_WORKERS ?= 3
test: venv
	@$(BIN)/python -m compileall -q shardsafe adapters kernels examples tests bench >/dev/null
	@base=$$(mktemp -d /tmp/sst-XXXXXX) && \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --basetemp=$$base \
		--durations=25 tests \
	&& rm -rf $$base

# Everything Megatron once more on megatron-core 0.19.2, which imports triton unconditionally; not part
# of `make test` (a 290 MB download): the core API (state layer, own-loop fault tests) with 0.19.2 as the
# venv's megatron-core, then Megatron-LM's loop (its 0.18+ calling convention) from the same side folder.
test-mcore019: venv
	test -d $(VENV)/mcore-0.19.2/megatron || $(BIN)/pip install -q --no-deps --ignore-requires-python \
		--target $(VENV)/mcore-0.19.2 megatron-core==0.19.2 triton==3.9.0
	PYTHONPATH=$(VENV)/mcore-0.19.2 $(BIN)/python -m pytest -q tests/dist/test_megatron_state.py \
		tests/fault/test_megatron_resume.py -k "not megatron_lm"
	SHARDSAFE_TEST_MCORE_LM=$(CURDIR)/$(VENV)/mcore-0.19.2 $(BIN)/python -m pytest -q \
		tests/fault/test_megatron_resume.py tests/fault/test_export_megatron.py tests/unit/test_megatron_args.py \
		tests/fault/test_inplace.py \
		-k "megatron_lm or export"

test-slurm: venv
	$(BIN)/python -m pytest -q tests/slurm

clean:
	rm -rf $(VENV) build *.egg-info
