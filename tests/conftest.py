import contextlib
import gc
import os
import sys

import pytest
import torch

from tp_fuse import settings

# Tests import helpers such as `tolerances` and `dist_utils` as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

# The suite starts a few hundred Python processes (launcher runs, torchrun agents and ranks),
# each importing tp_fuse's ~300 source files. Where the environment sets
# PYTHONDONTWRITEBYTECODE (this project's CI image does), no bytecode is ever cached, and
# every process compiled them again: ~0.4 CPU-s each. The suite's processes write it as
# Python does by default (the gitignored __pycache__ folders); the variable's absence is
# also what a user's shell has.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Inductor compiles a graph's kernels in a pool of worker subprocesses (one per core), which
# it starts and warms up in every process that compiles. On this suite's 2-core machine the
# pool cost more than it saved (test_compile_tp_overlap, 2 compiling ranks: 94.6 CPU-s with
# it, 80.2 without). One thread compiles in-process; set in the environment so that ranks and
# launcher subprocesses the tests start inherit it (inductor's config reads it on import).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# One intra-op thread in the test processes, as the ranks (dist_utils) and the launcher
# subprocesses already have. With two, every parallel region of an eager op or an
# inductor-compiled C++ kernel wakes a second OpenMP thread, which spin-waits for work on a
# machine the suite keeps saturated. Measured with a cold inductor cache, two modules at a
# time on the loaded 2-core machine: test_compile_ops 30.9 / 29.3 -> 25.5 / 25.8 CPU-s,
# test_compile_layer 80.6 -> 71.5. Set in the environment for the processes the tests
# start, and here for this process (torch is already imported).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


# Test modules that start processes (torchrun / launcher subprocesses, 2-4 gloo ranks, the
# Triton interpreter or a fresh venv in a subprocess) or compile with inductor. The process
# starters were ~95% of the full suite's time (1,246 of 1,320 s on the 2-core machine), so
# `make test-quick` (``pytest -m "not slow"``) leaves these out: it runs the single-process,
# uncompiled tests of every room. CI and `make test` run everything. A new module that
# starts processes or compiles belongs in this list.
SLOW_MODULES = frozenset({
    "test_bench_gpu",
    "test_block_kernels_interpret",
    "test_block_recipes_tp",
    "test_checkpoint_dir_lock",
    "test_checkpoint_integrity",
    "test_checkpoint_restart",
    "test_checkpoint_safety",
    "test_checkpoint_save_limits",
    "test_collective_timeout",
    "test_comm_backend",
    "test_comm_collectives",
    "test_comm_overlap",
    "test_comm_topology",
    "test_comm_userbuffers",
    "test_compile",
    "test_compile_fp8_cuda_path",
    "test_compile_layer",
    "test_compile_ops",
    "test_compile_tp",
    "test_compile_tp_cuda_path",
    "test_compile_tp_overlap",
    "test_cuda_readiness",
    "test_debug_api",
    "test_dist_utils",
    "test_documented_commands",
    "test_documented_commands_more",
    "test_export_hf_atomic",
    "test_fp8_amax_reduction",
    "test_fp8_stats_fused",
    "test_fsdp",
    "test_fsdp_launch",
    "test_gpu_check",
    "test_health_syncs",
    "test_kernels",
    "test_kernels_interpret",
    "test_launch_block_recipes",
    "test_launch_budget",
    "test_launch_cli_errors",
    "test_launch_config",
    "test_launch_cuda_graphs",
    "test_launch_grads",
    "test_launch_hf",
    "test_launch_imports",
    "test_launch_observability",
    "test_launch_scripts",
    "test_launch_tokenizer",
    "test_launch_train",
    "test_launch_validation",
    "test_layers_gpt",
    "test_layers_oracle",
    "test_makefile",
    "test_megatron_te_spec",
    "test_no_host_sync",
    "test_nvfp4_triton",
    "test_overlap_auto",
    "test_overlap_symm_mem",
    "test_packaging",
    "test_plot_fp8_stats",
    "test_preemption",
    "test_process_exit",
    "test_run_integrity",
    "test_te_attention_modules",
    "test_te_modules",
    "test_te_row_parallel_bias",
    "test_te_tensor_parallel",
    "test_te_userbuffers_setup",
    "test_tp_comm_errors",
    "test_tp_overlap",
    "test_wrap",
    "test_wrap_correctness",
    "test_wrap_fused_split",
    "test_wrap_models",
    "test_wrap_native_models",
    "test_wrap_olmo2",
    "test_wrap_plan_refusals",
})


#: The longest modules (measured, docs/benchmarks.md), longest first. make test's xdist
#: workers take whole modules in collection order, so these start first: a long module
#: started last would run alone at the end while the other worker idles.
LONGEST_FIRST = (
    "test_documented_commands_more",
    "test_documented_commands",
    "test_launch_hf",
    "test_compile_tp_overlap",
    "test_compile_layer",
    "test_export_hf_atomic",
    "test_checkpoint_restart",
    "test_launch_budget",
    "test_kernels_interpret",
    "test_fsdp_launch",
    "test_no_host_sync",
    "test_compile_tp",
    "test_compile_fp8_cuda_path",
    "test_dist_utils",
    "test_compile_ops",
    "test_launch_observability",
    "test_checkpoint_dir_lock",
    "test_compile",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    # The objects of every import made so far (torch, transformers, the test modules: ~500k)
    # are left out of all later collections: the launcher collects after each in-process
    # train() and every full collection walked them all (0.2-0.3 CPU-s). Objects the tests
    # create are still collected. tests/dist_utils.py does the same in each rank.
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    # Back to the interpreter's final collection, which frees them as it always did
    # (nanobind, in Triton, reports objects left unfreed at exit as leaks).
    gc.unfreeze()


@pytest.fixture
def tp_settings():
    """``tp_settings(TP_FUSE_STRICT_CUDA="1", ...)`` changes tp_fuse's environment switches
    for the rest of the test (``tp_fuse.settings.override``: the variables and the settings
    snapshot); everything is restored after it. ``None`` unsets a variable."""
    with contextlib.ExitStack() as stack:
        yield lambda **variables: stack.enter_context(settings.override(**variables))


@pytest.fixture(scope="session", autouse=True)
def _private_peak_cache(tmp_path_factory):
    """The launcher caches its measured CPU peak under ``$XDG_CACHE_HOME/tp-fuse``: tests
    (and the launcher processes they start, which inherit the environment) use a cache of
    their own, measured once per session, never the user's."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old
