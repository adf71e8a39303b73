# Two commands on a fresh machine:
#   make train   runs the main job on its default config
#   make test    installs what is missing and runs the full test suite
PYTHON ?= python3

.PHONY: install train test bench

install:
	$(PYTHON) -m pip install -q "torch==2.13.0" || $(PYTHON) -m pip install -q "torch>=2.6"
	$(PYTHON) -m pip install -q -e ".[test]"

train: install
	$(PYTHON) examples/train_mlp.py

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) examples/bench_fuser_overhead.py
