# Two commands on a fresh machine:
#   make train   runs the main job on its default config
#   make test    installs what is missing and runs the full test suite
#   make test-quick  the single-process tests only (under a minute): the loop while changing one room
PYTHON ?= python3
# make train NPROC=2 ARGS="fp8=delayed parallel.tp=2"  (any launch/train.py override)
NPROC ?= 1
ARGS ?=
# Install once: the stamp's name carries a checksum of pyproject.toml, so editing the
# dependencies reinstalls, and every later call runs offline (no pip at all).
STAMP_DIR ?= .make
PYPROJECT_SUM := $(shell cksum pyproject.toml | cut -d' ' -f1)
STAMP := $(STAMP_DIR)/installed-$(PYPROJECT_SUM)

.PHONY: install train test test-quick bench gpu-check

install: $(STAMP)

# The editable build needs setuptools>=68 (pyproject's build-system). When it is
# already installed, build without isolation: pip then fetches nothing it already has.
$(STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==2.13.0" || $(PYTHON) -m pip install -q "torch>=2.6"
	if $(PYTHON) -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null; then \
		$(PYTHON) -m pip install -q --no-build-isolation -e ".[test]"; \
	else \
		$(PYTHON) -m pip install -q -e ".[test]"; \
	fi
	mkdir -p $(STAMP_DIR) && rm -f $(STAMP_DIR)/installed-* && touch $(STAMP)

train: install
	WORLD_SIZE=$(NPROC) $(PYTHON) -m tp_fuse.launch.config_errors +model=gpt $(ARGS)
	$(PYTHON) -m torch.distributed.run --nproc-per-node=$(NPROC) --rdzv-backend=c10d --rdzv-endpoint=localhost:0 \
		launch/train.py +model=gpt $(ARGS)

# Two workers (pytest-xdist), each running whole modules (--dist loadfile: a module's
# process groups start once): the suite is mostly process start-up and waiting, which
# two workers overlap.
test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadfile tests

# Leaves out the modules that start processes or compile (tests/conftest.py: SLOW_MODULES),
# on two workers (pytest-xdist): the in-process tests are CPU-bound and independent.
test-quick: install
	$(PYTHON) -m pytest -q -n 2 -m "not slow" tests

bench: install
	$(PYTHON) examples/bench_fuser_overhead.py

# make gpu-check: on a CUDA machine, examples/bench_gpu.py first (torch vs tp_fuse bf16 vs FP8,
# < 5 min), then GPU tests + Triton vs torch + kernel/GEMM benchmarks + 100-step bf16/FP8 GPT
# runs + TP=2 through gloo, summary in gpu_check_out/ (< 14 min).
# Without CUDA it prints one line and succeeds.
gpu-check: install
	$(PYTHON) tools/gpu_check.py
