"""The modules ``wrap()`` puts in place of the ones it converts, keeping the model's interface.

A converted module must look like the one it replaced to everything outside it:

* ``state_dict()`` keys and per-rank shapes are the original's (``fc1.weight``,
  ``fc1.bias``, Megatron's ``_extra_state``): the weight and bias are registered on the
  adapter itself, the tp-fuse layer inside (``_tp``) holds the very same ``Parameter``
  objects, and its duplicate keys are dropped from ``state_dict`` (and filled from the
  outer keys on ``load_state_dict``);
* Megatron layers keep their attributes, their ``(output, bias)`` returns, their
  ``sharded_state_dict`` (the original class's method, run on the adapter, whose keys
  and attributes are the same) and a weight passed at call time (a tied output layer);
* plain ``nn.Linear`` / GPT-2 ``Conv1D`` modules keep returning one tensor.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch

from ..parallel_linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["HF_RMS_NORMS", "MegatronLinearAdapter", "ParallelLinearAdapter", "ShardedRMSNorm", "megatron_adapter"]

# Megatron layer attributes that model code reads (copied onto the adapter as they were).
_MEGATRON_ATTRS = ("input_size", "output_size", "output_size_per_partition", "input_size_per_partition",
                   "gather_output", "input_is_parallel", "skip_bias_add", "sequence_parallel", "config",
                   "tp_group", "tp_size", "is_expert", "explicit_expert_comm", "disable_grad_reduce",
                   "gradient_accumulation_fusion", "skip_weight_param_allocation", "allreduce_dgrad",
                   "te_return_bias", "stride")


class _KeepsOriginalKeys(torch.nn.Module):
    """Registers ``weight``/``bias`` on itself; the inner layer ``_tp`` shares them."""

    weight: Optional[torch.nn.Parameter]
    bias: Optional[torch.nn.Parameter]

    def _adopt(self, tp_layer: torch.nn.Module, weight: Optional[torch.nn.Parameter],
               bias: Optional[torch.nn.Parameter]) -> None:
        # Order matters: named_parameters() de-duplicates by first appearance, so the outer
        # names ("weight", "bias") are the ones users and optimizers see.
        self.weight = weight
        self.bias = bias
        self._tp = tp_layer
        self._register_state_dict_hook(_drop_inner_keys)
        self._register_load_state_dict_pre_hook(_fill_inner_keys, with_module=True)

    def _inner_aliases(self) -> dict[str, str]:
        """``{inner name under _tp: outer name}`` for the shared parameters."""
        out = {}
        for name, p in self._tp.named_parameters(remove_duplicate=False):
            if p is self.weight and p is not None:
                out[name] = "weight"
            elif p is self.bias and p is not None:
                out[name] = "bias"
        return out


def _drop_inner_keys(module: _KeepsOriginalKeys, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "_tp.")]:
        del state_dict[key]


def _fill_inner_keys(module: _KeepsOriginalKeys, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                     missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    if getattr(module, "transposed", False) and isinstance(state_dict.get(prefix + "weight"), torch.Tensor):
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()  # Conv1D layout [in, out] -> [out, in]
    for inner, outer in module._inner_aliases().items():
        if prefix + outer in state_dict:
            state_dict[prefix + "_tp." + inner] = state_dict[prefix + outer]
    # The inner ops' ``_extra_state`` (FP8 scaling state, tp_fuse.ops.extra_state) is not
    # among the original's keys: an original-format state dict keeps the current state.
    for name, sub in module._tp.named_modules():
        if type(sub).get_extra_state is not torch.nn.Module.get_extra_state:
            key = prefix + "_tp." + (name + "." if name else "") + "_extra_state"
            if key not in state_dict:
                state_dict[key] = sub.get_extra_state()
    # A tied weight lent at call time is owned (and loaded) elsewhere.
    for name, p in module._tp.named_parameters(remove_duplicate=False):
        key = prefix + "_tp." + name
        if key not in state_dict and p is getattr(module, "_lent_weight", None):
            state_dict[key] = p.detach()


class ParallelLinearAdapter(_KeepsOriginalKeys):
    """A column/row-parallel layer behind ``nn.Linear``'s call interface (returns a tensor).

    Shapes: column ``[..., in] -> [..., out/tp]``; row ``[..., in/tp] -> [..., out]``
    (first dim split over TP with sequence parallelism, as for the wrapped layers).
    ``weight`` is ``[out/tp, in]`` / ``[out, in/tp]`` like a sharded ``nn.Linear``.

    With ``transposed=True`` (GPT-2's ``Conv1D``, which stores ``W [in, out]``) the
    parameter is still ``[out/tp, in]`` for the GEMM, but ``state_dict`` saves and loads
    it transposed, so checkpoints keep Conv1D's layout and per-rank shapes.
    """

    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear, in_features: int, out_features: int,
                 transposed: bool = False) -> None:
        super().__init__()
        self._adopt(layer, layer.weight, layer.bias)
        self.in_features, self.out_features = in_features, out_features
        self.transposed = bool(transposed)
        if self.transposed:
            self._register_state_dict_hook(_save_transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self._tp(x)
        return out


def _save_transposed(module: ParallelLinearAdapter, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    if prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()


class MegatronLinearAdapter(_KeepsOriginalKeys):
    """A tp-fuse column/row-parallel layer in the place of a Megatron-core one.

    Same attributes, same ``forward`` signature and ``(output, bias_or_None)`` return,
    same ``state_dict`` keys (incl. ``_extra_state`` when the original had it), the
    original class's ``sharded_state_dict``. A column layer built with
    ``skip_weight_param_allocation`` (tied output layer) takes its weight at call time:
    the GEMM uses the tensor passed in (it must be a ``Parameter`` of shape
    ``[output_size_per_partition, input_size]``); it is not part of this module's
    ``state_dict`` (its owner, e.g. the embedding, saves it).
    """

    def __init__(self, original: torch.nn.Module, tp_layer: ColumnParallelLinear | RowParallelLinear,
                 kind: str) -> None:
        super().__init__()
        self.kind = kind
        weight = None if original.weight is None else tp_layer.weight
        self._adopt(tp_layer, weight, tp_layer.bias)
        self.__dict__["_lent_weight"] = None  # the tied weight lent at call time (not registered)
        for attr in _MEGATRON_ATTRS:
            if attr in vars(original) or hasattr(type(original), attr) and not callable(getattr(type(original), attr)):
                object.__setattr__(self, attr, getattr(original, attr))
        self._original_class = type(original)
        if hasattr(type(original), "sharded_state_dict"):
            self.sharded_state_dict = types.MethodType(type(original).sharded_state_dict, self)

    def _lend_weight(self, weight: torch.Tensor) -> None:
        """Make the GEMM use ``weight`` (a tied output layer's call-time weight)."""
        if self.kind != "column":
            raise ValueError("RowParallelLinear takes no weight at call time")
        if not isinstance(weight, torch.nn.Parameter):
            raise ValueError(f"weight passed at call time must be a torch.nn.Parameter (the tied embedding "
                             f"weight), got {type(weight).__name__}")
        linear = self._tp.ops.linear
        want = (linear.out_features, linear.in_features)
        if tuple(weight.shape) != want:
            raise ValueError(f"weight passed at call time has shape {tuple(weight.shape)}, expected {want}")
        if linear.weight is not weight:
            # The op's weight slot points at the lent Parameter: autograd sees it as this
            # GEMM's parameter, so its gradient accumulates into the owner's .grad.
            linear._parameters["weight"] = weight
            # A plain attribute, not a registered Parameter: its owner saves and loads it.
            self.__dict__["_lent_weight"] = weight

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.kind == "row":
            if weight is not None or runtime_gather_output is not None:
                raise ValueError("RowParallelLinear.forward takes only the input")
            return self._tp(input_)
        if weight is None:
            if self.weight is None:
                raise ValueError("this layer was built with skip_weight_param_allocation=True: pass `weight` "
                                 "to forward")
        elif self.weight is not None and weight is not self.weight:
            raise ValueError("this layer owns its weight; a different weight was passed at call time")
        else:
            self._lend_weight(weight)
        return self._tp(input_, runtime_gather_output=runtime_gather_output)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, original={self._original_class.__name__}"


class _MegatronLinearAdapterWithExtraState(MegatronLinearAdapter):
    """For originals that store ``_extra_state`` (megatron-core's layers: None, kept for
    Transformer Engine compatibility): the adapter stores and restores it the same way."""

    def __init__(self, original: torch.nn.Module, tp_layer: ColumnParallelLinear | RowParallelLinear,
                 kind: str) -> None:
        super().__init__(original, tp_layer, kind)
        self._extra_state = original.get_extra_state()

    def get_extra_state(self) -> Any:
        return self._extra_state

    def set_extra_state(self, state: Any) -> None:
        self._extra_state = state


def megatron_adapter(original: torch.nn.Module, tp_layer: ColumnParallelLinear | RowParallelLinear,
                     kind: str) -> MegatronLinearAdapter:
    """The adapter for ``original``, with ``_extra_state`` exactly when the original has it."""
    has_extra = type(original).get_extra_state is not torch.nn.Module.get_extra_state
    cls = _MegatronLinearAdapterWithExtraState if has_extra else MegatronLinearAdapter
    return cls(original, tp_layer, kind)


# RMSNorm classes whose forward is exactly ``weight * (x * rsqrt(mean(x^2) + eps))`` in
# float32, cast back to the input's dtype, eps in ``variance_epsilon``: the ones the
# "sharded_norm" plan style may replace. Gemma's ``(1 + weight)``, Cohere's mean-subtracted
# "LayerNorm" and others would be silently wrong under that formula, so they are refused
# by name rather than recognised by their attributes.
HF_RMS_NORMS = ("Olmo2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class _AllReduceSum(torch.autograd.Function):
    """``y = sum_r x_r`` over the TP group; backward ``dx = sum_r dy_r``.

    Both directions sum: every rank uses the summed statistic for its own features, so
    the gradient reaching it on one rank is only that rank's part of the true one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed._functional_collectives as funcol

        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(dy.contiguous(), "sum", ctx.group)), None


class ShardedRMSNorm(torch.nn.Module):
    """An RMSNorm over the output features of a column-parallel projection (OLMo2's
    ``q_norm`` / ``k_norm``: one norm over all heads' features, ``[heads * head_dim]``).

    After ``wrap`` each rank holds only its slice of those features, so both the weight
    and the statistic must follow them: the weight is sharded like the projection's
    output (``ShardSpec(dim=0)``, rank r holds features ``[r w/tp, (r+1) w/tp)``), and the
    mean of squares is the TP-sum of the per-rank sums of squares divided by the FULL
    width. A replicated norm would instead fail on the shapes, or -- normalising each
    rank's slice on its own -- be silently wrong.

    Computes ``x * rsqrt(mean(x^2) + eps)`` in float32 and multiplies by the weight after
    casting back to ``x``'s dtype (``weight_after_cast``: Llama's order) or before (OLMo2's
    order), as the replaced module did, so that low-precision rounding is the same too;
    ``torch.nn.RMSNorm`` with ``eps=None`` uses ``torch.finfo(x.dtype).eps`` as torch
    does. ``state_dict`` keys are the original's (``weight``).
    """

    def __init__(self, weight: Optional[torch.Tensor], full_width: int, eps: Optional[float], tp_group: Any,
                 weight_after_cast: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight) if weight is not None else None
        self.full_width = full_width
        self.eps = eps
        self.tp_group = tp_group
        self.weight_after_cast = weight_after_cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        squares = _AllReduceSum.apply(x32.pow(2).sum(-1, keepdim=True), self.tp_group)
        eps = self.eps if self.eps is not None else torch.finfo(dtype).eps
        y = x32 * torch.rsqrt(squares / self.full_width + eps)
        if self.weight is None:
            return y.to(dtype)
        if self.weight_after_cast:
            return self.weight * y.to(dtype)
        return (self.weight * y).to(dtype)

    def extra_repr(self) -> str:
        local = self.weight.shape[0] if self.weight is not None else self.full_width
        return f"local {local} of {self.full_width} features, eps={self.eps}, statistics summed over TP"
