# Two commands on a fresh machine:
#   make train   runs the main job on its default config
#   make test    installs what is missing and runs the full test suite
PYTHON ?= python3
# make train NPROC=2 ARGS="fp8=delayed parallel.tp=2"  (any launch/train.py override)
NPROC ?= 1
ARGS ?=

.PHONY: install train test bench gpu-check

install:
	$(PYTHON) -m pip install -q "torch==2.13.0" || $(PYTHON) -m pip install -q "torch>=2.6"
	$(PYTHON) -m pip install -q -e ".[test]"

train: install
	$(PYTHON) -m torch.distributed.run --nproc-per-node=$(NPROC) --rdzv-backend=c10d --rdzv-endpoint=localhost:0 \
		launch/train.py +model=gpt $(ARGS)

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) examples/bench_fuser_overhead.py

# make gpu-check: on a CUDA machine, GPU tests + Triton vs torch + kernel/GEMM benchmarks +
# 100-step bf16/FP8 GPT runs + TP=2 through gloo, summary in gpu_check_out/ (< 9 min).
# Without CUDA it prints one line and succeeds.
gpu-check: install
	$(PYTHON) tools/gpu_check.py
