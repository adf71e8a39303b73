"""CPU shims that let megatron-core 0.16's ``GPTModel`` run on a CUDA-less torch (tests only).

megatron-core assumes a GPU in three places that a CPU forward/backward reaches:

* ``CudaRNGStatesTracker`` (``model_parallel_cuda_manual_seed``, dropout under
  ``get_cuda_rng_tracker().fork()``) reads and writes ``torch.cuda`` RNG states: here
  the tracked states are CPU generator states and ``fork`` swaps the CPU RNG state;
* ``GlobalMemoryBuffer.get_tensor`` (core attention's matmul buffer) allocates on
  ``torch.cuda.current_device()``: here on the CPU;
* ``torch.cuda.current_device()`` as the device of new tensors (RoPE frequencies,
  sequence-parallel gather/scatter outputs): here it returns the CPU device (only in
  the spawned test ranks, which never touch CUDA);
* the default causal mask is built with ``device="cuda"``: here on the CPU;
* the MoE router's GEMM reads ``moe_utils.te_general_gemm``, which 0.16.1 only defines
  when Transformer Engine imports: here it is None (the plain torch GEMM).

``parallel_state.initialize_model_parallel`` itself is fine on gloo.

This is the ONLY place with such shims; library code never patches megatron-core.
``install()`` is idempotent and meant for the spawned test ranks.
"""

from __future__ import annotations

import warnings
from functools import reduce
import operator
from typing import Any, Optional

import torch

_INSTALLED = False


def install() -> None:
    """Patch megatron-core's CUDA-only helpers with CPU equivalents (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str,
                   mem_alloc_context: Optional[Any] = None) -> torch.Tensor:
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = causal_mask
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    mutils.GlobalMemoryBuffer.get_tensor = get_tensor
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _INSTALLED = True


def init_model_parallel(tp: int, seed: int = 1234) -> None:
    """megatron-core's parallel state for TP=``tp`` over the (gloo) world, CPU RNG tracker seeded."""
    install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    mrandom.get_cuda_rng_tracker().reset()
    mrandom.model_parallel_cuda_manual_seed(seed)


class SequenceParallelTorchNorm:
    """torch ``LayerNorm``/``RMSNorm`` for a megatron-core layer spec, usable with
    ``sequence_parallel=True`` (megatron's ``WrappedTorchNorm`` refuses it; its SP norm is
    apex's, which needs CUDA). Parameters are tagged ``sequence_parallel`` as Megatron's
    own norms are, for ``finalize_model_grads`` (here: :func:`allreduce_sequence_parallel_grads`)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def local_spec(normalization: str, sequence_parallel_norms: bool, num_layers: int) -> Any:
    """megatron-core's local GPT spec; with SP-capable torch norms when asked (final norm too)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(normalization=normalization)
    if not sequence_parallel_norms:
        return spec
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelTorchNorm)


def allreduce_sequence_parallel_grads(model: torch.nn.Module, group: Any) -> None:
    """What Megatron's ``finalize_model_grads`` does for ``sequence_parallel``-tagged params."""
    import torch.distributed as dist

    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
