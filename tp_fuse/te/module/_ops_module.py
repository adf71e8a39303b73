"""What TE's module classes here (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``) share:
a ``torch.nn.Module`` whose computation is one ``tp_fuse.layers`` block (its ops and its
forward) and whose parameters carry Transformer Engine's names.

The block is not a submodule (its parameter names would be ``_ops.ops.linear.weight``...):
the module registers the ops' own ``Parameter`` objects under TE's names (``weight``,
``layer_norm_weight``, ``fc1_weight``...), so ``parameters()``, ``state_dict()`` and
optimizers see exactly TE's names, and before every forward pass the ops are pointed
again at whatever the module now holds (``module.weight = Parameter(...)`` works).
``weight.data = ...`` and ``load_state_dict`` write into the shared objects.

Argument checking: every TE constructor argument is accepted by name; one whose value
asks for something tp_fuse does not do here raises ``ValueError`` naming it and what is
supported (:func:`refuse_unless`), never silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.ops.basic._tp import group_size
from tp_fuse.ops.basic.layer_norm import LayerNorm
from tp_fuse.ops.basic.rmsnorm import RMSNorm
from tp_fuse.quantization import active_autocast
from tp_fuse.quantization.parameter import is_fp8_parameter
from tp_fuse.quantization.float8.delayed_scaling import DelayedScalingQuantizer

#: ``_extra_state`` of a module with several GEMMs: JSON of each op's own extra state.
_FORMAT = "tp_fuse.module"
_VERSION = 1


def refuse_unless(cls: str, arg: str, ok: bool, value: Any, supported: str) -> None:
    """ValueError ``<cls>: <arg>=<value> is not supported by tp_fuse (<supported>)`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{cls}: {arg}={value!r} is not supported by tp_fuse ({supported})")


def check_common_args(cls: str, *, sequence_parallel: bool, tp_group: Any, tp_size: int,
                      get_rng_state_tracker: Any, rng_tracker_name: Any, parameters_split: Any,
                      delay_wgrad_compute: bool, symmetric_ar_type: Any, ub: dict[str, Any],
                      device: Any, params_dtype: Any, return_bias: bool, bias: bool,
                      fuse_wgrad_accumulation: bool) -> int:
    """The checks TE's GEMM modules share; returns the TP size."""
    for arg, value in (("sequence_parallel", sequence_parallel), ("return_bias", return_bias), ("bias", bias),
                       ("fuse_wgrad_accumulation", fuse_wgrad_accumulation),
                       ("delay_wgrad_compute", delay_wgrad_compute)):
        if not isinstance(value, bool):
            raise ValueError(f"{cls}: {arg} must be a bool, got {value!r}")
    if parameters_split is not None and not isinstance(parameters_split, (tuple, list, dict)):
        raise ValueError(f"{cls}: parameters_split must be None, a tuple of names or a dict name -> size, "
                         f"got {parameters_split!r}")
    refuse_unless(cls, "parameters_split", parameters_split is None or not fuse_wgrad_accumulation,
                  parameters_split, "None with fuse_wgrad_accumulation=True (main_grad needs one weight tensor)")
    refuse_unless(cls, "parameters_split", parameters_split is None or not return_bias, parameters_split,
                  "None with return_bias=True (the returned bias is one tensor)")
    refuse_unless(cls, "parameters_split", parameters_split is None or not delay_wgrad_compute, parameters_split,
                  "None with delay_wgrad_compute=True (backward_dw() adds dW into one weight parameter)")
    refuse_unless(cls, "symmetric_ar_type", symmetric_ar_type is None, symmetric_ar_type,
                  "None: the standard all-reduce")
    for arg, value in ub.items():
        refuse_unless(cls, arg, not value, value,
                      "False: for comm+GEMM overlap build tp_fuse.ops with TPOverlap or "
                      "module.base.initialize_ub and ops userbuffers_options")
    refuse_unless(cls, "rng_tracker_name", rng_tracker_name is None or get_rng_state_tracker is not None,
                  rng_tracker_name, "a tracker name together with get_rng_state_tracker")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise ValueError(f"{cls}: get_rng_state_tracker must be callable, got {get_rng_state_tracker!r}")
    if params_dtype is not None and not isinstance(params_dtype, torch.dtype):
        raise ValueError(f"{cls}: params_dtype must be a torch.dtype, got {params_dtype!r}")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise ValueError(f"{cls}: device must be a str or torch.device, got {device!r}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{cls}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is None:
        refuse_unless(cls, "tp_size", tp_size == 1, tp_size,
                      "tp_size > 1 only with tp_group (set_tensor_parallel_group after construction "
                      "is not supported: the shards are made at construction)")
        return 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{cls}: tp_group was given but torch.distributed is not initialized")
    size = group_size(tp_group)
    refuse_unless(cls, "tp_size", tp_size in (1, size), tp_size, f"the size of tp_group ({size}) or 1")
    return size


def split_sizes(cls: str, parameters_split: Any, out_features: int, tp_size: int,
                column: bool) -> Optional[list[tuple[str, int]]]:
    """TE's ``parameters_split`` as ``[(name, local rows)]`` (None: one weight). A tuple of names
    splits ``out_features`` equally, a dict gives each name's size; a column-parallel layer
    holds ``size / tp`` rows of each (its own ``[q_r; k_r; v_r]``). Parameter names are TE's:
    ``<name without trailing '_'>_weight`` / ``_bias``."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        sizes = dict(parameters_split)
        if sum(sizes.values()) != out_features:
            raise ValueError(f"{cls}: parameters_split sizes {sizes} must sum to out_features ({out_features})")
    else:
        names = list(parameters_split)
        if len(set(names)) != len(names):
            raise ValueError(f"{cls}: parameters_split names must be distinct, got {tuple(names)}")
        if not names or out_features % len(names):
            raise ValueError(f"{cls}: parameters_split {tuple(names)} must split out_features ({out_features}) "
                             "into equal parts")
        sizes = {name: out_features // len(names) for name in names}
    out = []
    for name, size in sizes.items():
        if not isinstance(name, str) or not name.rstrip("_"):
            raise ValueError(f"{cls}: parameters_split names must be non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{cls}: parameters_split size of {name!r} must be a positive int, got {size!r}")
        if column and size % tp_size:
            raise ValueError(f"{cls}: parameters_split size of {name!r} ({size}) must be divisible by the "
                             f"tensor-parallel size ({tp_size})")
        out.append((name.rstrip("_"), size // tp_size if column else size))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"{cls}: parameters_split names must be distinct, got {[n for n, _ in out]}")
    return out


def init_fn(init_method: Optional[Callable], get_rng_state_tracker: Optional[Callable],
            rng_tracker_name: Optional[str]) -> Callable[[torch.Tensor], Any]:
    """TE's weight initialization: ``init_method(w)`` (default ``normal_(0, 0.023)``), inside
    ``get_rng_state_tracker().fork(rng_tracker_name)`` when a tracker is given."""
    method = init_method if init_method is not None else (lambda w: torch.nn.init.normal_(w, mean=0.0, std=0.023))
    if get_rng_state_tracker is None:
        return method

    def run(w: torch.Tensor) -> None:
        tracker = get_rng_state_tracker()
        fork = tracker.fork() if rng_tracker_name is None else tracker.fork(rng_tracker_name)
        with fork:
            method(w)

    return run


def set_megatron_attrs(param: Optional[torch.Tensor], parallel: bool, dim: int) -> None:
    """Megatron-LM's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``, as TE sets them."""
    if param is None:
        return
    param.tensor_model_parallel = parallel
    param.partition_dim = dim
    param.partition_stride = 1


class FP8MetaView:
    """One direction of TE's ``fp8_meta`` (``scaling_fwd`` / ``scaling_bwd``): ``scale``,
    ``scale_inv`` and ``amax_history`` stacked over TE's tensor indices (a snapshot, read-only)."""

    def __init__(self, quantizers: list[Optional[DelayedScalingQuantizer]]) -> None:
        present = [q for q in quantizers if q is not None]
        device = present[0].scale.device if present else None
        one = torch.ones((), device=device)
        self.scale = torch.stack([q.scale.detach().float() if q is not None else one for q in quantizers])
        self.scale_inv = torch.reciprocal(self.scale)
        hist_len = present[0].amax_history.numel() if present else 1
        zeros = torch.zeros(hist_len, device=device)
        self.amax_history = torch.stack(
            [q.amax_history.detach().float() if q is not None else zeros for q in quantizers], dim=1)


class OpsModule(torch.nn.Module):
    """Base of TE's module classes built on ``tp_fuse.ops`` (see the module docstring)."""

    def __init__(self, name: Optional[str]) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{type(self).__name__}: name must be a str or None, got {name!r}")
        #: The debug layer name (TE's ``name``; also set by ``debug_api.infer_and_assign_layer_names``).
        self.name = name
        self.__dict__["_param_map"] = {}
        self.__dict__["_split_map"] = {}
        self.__dict__["_wgrad_ops"] = []
        self.__dict__["_wgrad_hooks"] = []

    # ---- wiring ------------------------------------------------------------

    def _bind(self, ops: torch.nn.Module, params: dict[str, tuple[torch.nn.Module, str]],
              linears: dict[str, Any]) -> None:
        """Own ``ops`` (the layers block, not a submodule) and register its parameters under TE's
        names; ``linears`` maps a debug-name suffix ("" or "fc1") to its BasicLinear."""
        self.__dict__["_ops"] = ops
        self.__dict__["_param_map"] = dict(params)
        self.__dict__["_linears"] = dict(linears)
        self.__dict__["_split_map"] = {}
        for te_name, (op, attr) in params.items():
            self.register_parameter(te_name, op._parameters[attr])

    def _split(self, te_name: str, parts: list[tuple[str, int]], suffix: str) -> None:
        """TE's ``parameters_split``: replace parameter ``te_name`` by one parameter per part,
        ``<part>_<suffix>`` (rows of the original, same values, same attributes); the op reads
        their concatenation (made again at every forward, so gradients reach the parts)."""
        whole = self._parameters.pop(te_name)
        op, attr = self._param_map.pop(te_name)
        names, start = [], 0
        for part, rows in parts:
            name = f"{part}_{suffix}"
            piece = torch.nn.Parameter(whole.detach()[start:start + rows].clone(), requires_grad=whole.requires_grad)
            piece.__dict__.update(whole.__dict__)  # Megatron's attributes (partition_dim, sequence_parallel...)
            self.register_parameter(name, piece)
            names.append(name)
            start += rows
        self._split_map[te_name] = (op, attr, names)
        inits = self.__dict__.get("_inits", {})
        if te_name in inits:
            for name in names:
                inits[name] = inits[te_name]
            del inits[te_name]

    def _sync(self) -> None:
        """Point the ops at this module's parameters (they may have been replaced) and hand the
        debug name to the GEMMs (``<name>`` / ``<name>.fc1``...), as TE's debug quantizers use."""
        for te_name, (op, attr) in self._param_map.items():
            p = self._parameters.get(te_name)
            if op._parameters.get(attr) is not p:
                if p is None:
                    raise ValueError(f"{type(self).__name__}: parameter {te_name!r} was removed")
                op._parameters[attr] = p
        for te_name, (op, attr, names) in self._split_map.items():
            parts = [self._parameters.get(n) for n in names]
            if any(p is None for p in parts):
                raise ValueError(f"{type(self).__name__}: a parameter of {names} was removed")
            # A plain tensor in the op's parameter slot: the op reads it as its weight / bias.
            op._parameters[attr] = torch.cat(parts, dim=0)
        name = self.name
        for suffix, linear in self._linears.items():
            want = None if not name else (f"{name}.{suffix}" if suffix else name)
            if getattr(linear, "name", None) != want:
                linear.name = want

    def _run(self, inp: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
        if is_first_microbatch not in (None, True, False):
            raise ValueError(f"{type(self).__name__}: is_first_microbatch must be None, True or False, "
                             f"got {is_first_microbatch!r}")
        # is_first_microbatch is TE's weight-cache hint (reuse the FP8 weight of the first
        # micro-batch); tp_fuse quantizes the weight at every call, which gives the same
        # values while the weight is unchanged between micro-batches.
        self._sync()
        return self._ops(inp)

    def _delay_wgrad(self, ops: list[Any], delay: bool, weight_names: list[str]) -> None:
        """TE's ``delay_wgrad_compute`` on this module's GEMM ops (``BasicLinear`` /
        ``GroupedLinear``: the deferral lives there). As TE, the weights get
        ``skip_backward_post_hook`` (a DDP wrapper's hook must wait for :meth:`backward_dw`,
        see :meth:`register_wgrad_accumulation_and_reduce_hooks`); the biases' gradients are
        computed in the backward pass."""
        self.__dict__["_wgrad_ops"] = list(ops)
        for op in ops:
            op.delay_wgrad_compute = delay
        if delay:
            for name in weight_names:
                self._parameters[name].skip_backward_post_hook = True

    def unregistered_modules(self) -> list[torch.nn.Module]:
        """The modules this one runs but does not register (its ops block): where
        ``tp_fuse.checkpoint`` finds the FP8 quantizers whose scales a recompute replays."""
        ops = self.__dict__.get("_ops")
        return [ops] if ops is not None else []

    # ---- TE's module API ---------------------------------------------------

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether the weight gradients wait for :meth:`backward_dw` (TE's constructor argument)."""
        return any(op.delay_wgrad_compute for op in self._wgrad_ops)

    def need_backward_dw(self) -> bool:
        """TE's: whether :meth:`backward_dw` must run to finish the weight gradients."""
        return self.delay_wgrad_compute

    def backward_dw(self) -> None:
        """TE's ``backward_dw``: with ``delay_wgrad_compute=True``, compute the weight gradients
        the oldest backward pass deferred (each GEMM op's ``backward_dw``: added into
        ``weight.grad``, or ``weight.main_grad`` with ``fuse_wgrad_accumulation``, the bits
        the backward pass would have produced), then run the hooks of
        :meth:`register_wgrad_accumulation_and_reduce_hooks`. Nothing without it (TE's)."""
        if not self.need_backward_dw():
            return
        for op in self._wgrad_ops:
            op.backward_dw()
        for hook in self._wgrad_hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], Any]) -> None:
        """TE's: ``hook()`` runs at the end of every :meth:`backward_dw` (e.g. a DDP wrapper's
        gradient reduction, which must wait for the deferred weight gradients)."""
        if not callable(hook):
            raise ValueError(f"{type(self).__name__}.register_wgrad_accumulation_and_reduce_hooks: hook must be "
                             f"callable, got {hook!r}")
        self._wgrad_hooks.append(hook)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """TE's ``reset_parameters``: parameters on the ``meta`` device are materialized (on the
        current CUDA device where CUDA is available, else the CPU), then every parameter is
        initialized as at construction: GEMM weights with their ``init_method`` (in the RNG
        tracker's fork when one was given), norm weights 1 (0 with ``zero_centered_gamma``),
        biases 0. ``defer_init=True`` does nothing (TE's). FP8 parameters
        (``quantized_model_init``) are refused (ValueError)."""
        if defer_init:
            return
        inits = self.__dict__.get("_inits", {})
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        for name, p in list(self._parameters.items()):
            if p is None:
                continue
            if is_fp8_parameter(p):
                raise ValueError(f"{type(self).__name__}.reset_parameters: {name} is an FP8 parameter "
                                 "(quantized_model_init); re-initializing it is not supported by tp_fuse")
            if p.is_meta:
                new = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # Megatron's attributes (sequence_parallel, partition_dim...)
                self._parameters[name] = new
        self._sync()
        with torch.no_grad():
            for name, p in self._parameters.items():
                if p is None:
                    continue
                op = self._param_map.get(name, (None, None))[0]
                if name in inits:
                    inits[name](p)
                elif isinstance(op, (LayerNorm, RMSNorm)) and name.endswith("weight"):
                    op.reset_parameters()  # LayerNorm's resets its bias too: zero below either way
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    raise ValueError(f"{type(self).__name__}.reset_parameters: no initialization known for {name}")

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """TE's late TP-group setup: only the group given at construction is supported."""
        if tp_group is not self.tp_group:
            raise ValueError(f"{type(self).__name__}: set_tensor_parallel_group after construction is not "
                             "supported by tp_fuse (pass tp_group to the constructor)")

    @property
    def fp8_meta(self) -> dict[str, Any]:
        """TE's ``fp8_meta`` for delayed scaling, read-only: ``recipe``, ``scaling_fwd``
        (indices input 0, weight 1, output 2 per GEMM) and ``scaling_bwd`` (grad_output 0,
        grad_input 1 per GEMM); quantizers not built yet read as scale 1."""
        fwd: list[Optional[DelayedScalingQuantizer]] = []
        bwd: list[Optional[DelayedScalingQuantizer]] = []
        recipe = None
        for linear in self._linears.values():
            qs = {r: q for r, q in linear._quantizers.quantizers.items() if isinstance(q, DelayedScalingQuantizer)}
            if qs and recipe is None:
                recipe = next(iter(qs.values())).recipe
            fwd += [qs.get("input"), qs.get("weight"), None]
            bwd += [qs.get("grad_output"), None]
        state = active_autocast()
        return {"recipe": recipe if recipe is not None else (state.recipe if state is not None else None),
                "scaling_fwd": FP8MetaView(fwd), "scaling_bwd": FP8MetaView(bwd)}

    # ---- state dict ----------------------------------------------------------

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # An FP8 parameter (quantized_model_init) is saved as its master copy, as the ops do.
        for name, p in self._parameters.items():
            if p is not None and is_fp8_parameter(p):
                destination[prefix + name] = p.master if keep_vars else p.master.detach()

    def get_extra_state(self) -> torch.Tensor:
        """The GEMMs' FP8 state (``ops.BasicLinear.get_extra_state``; JSON, no pickle). One
        GEMM: its own tensor; several: one JSON object keyed by GEMM (``fc1``, ``fc2``)."""
        linears = self._linears
        if len(linears) == 1:
            return next(iter(linears.values())).get_extra_state()
        doc = {}
        for suffix, linear in linears.items():
            state = linear.get_extra_state()
            if state.numel():
                doc[suffix] = json.loads(bytes(state.numpy().tobytes()).decode("utf-8"))
        if not doc:
            return torch.empty(0, dtype=torch.uint8)
        raw = json.dumps({"format": _FORMAT, "version": _VERSION, "gemms": doc}).encode("utf-8")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    def set_extra_state(self, state: Any) -> None:
        linears = self._linears
        if len(linears) == 1:
            next(iter(linears.values())).set_extra_state(state)
            return
        cls = type(self).__name__
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise ValueError(f"{cls} _extra_state: expected a 1-D uint8 tensor of JSON, got {type(state).__name__}")
        try:
            doc = json.loads(bytes(state.cpu().numpy().tobytes()).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{cls} _extra_state: not tp_fuse JSON ({type(e).__name__})") from None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != _VERSION \
                or not isinstance(doc.get("gemms"), dict):
            raise ValueError(f"{cls} _extra_state: expected format {_FORMAT!r} version {_VERSION}")
        for suffix, sub in doc["gemms"].items():
            if suffix not in linears:
                raise ValueError(f"{cls} _extra_state: unknown GEMM {suffix!r} (have {sorted(linears)})")
            raw = json.dumps(sub).encode("utf-8")
            linears[suffix].set_extra_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())


def check_norm_args(cls: str, normalization: Any, eps: Any, zero_centered_gamma: Any) -> None:
    """TE's norm arguments: ``normalization`` "LayerNorm" / "RMSNorm", ``eps`` >= 0, a bool
    ``zero_centered_gamma`` (ValueError naming the argument otherwise)."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"{cls}: eps must be a non-negative float, got {eps!r}")
    if not isinstance(zero_centered_gamma, bool):
        raise ValueError(f"{cls}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
    refuse_unless(cls, "normalization", normalization in ("LayerNorm", "RMSNorm"), normalization,
                  "'LayerNorm' or 'RMSNorm'")


def norm_op(cls: str, normalization: str, size: int, eps: float, zero_centered_gamma: bool, device: Any,
            dtype: torch.dtype, sequence_parallel: bool) -> tuple[torch.nn.Module, dict[str, tuple[torch.nn.Module, str]]]:
    """TE's ``normalization`` ("LayerNorm" / "RMSNorm") as an op, and its parameters under TE's
    names (``layer_norm_weight``, ``layer_norm_bias``; TE sets ``sequence_parallel`` on them)."""
    check_norm_args(cls, normalization, eps, zero_centered_gamma)
    kind = LayerNorm if normalization == "LayerNorm" else RMSNorm
    op = kind(size, float(eps), device=device, dtype=dtype, zero_centered_gamma=zero_centered_gamma)
    params = {"layer_norm_weight": (op, "weight")}
    if normalization == "LayerNorm":
        params["layer_norm_bias"] = (op, "bias")
    for _, (o, attr) in params.items():
        o._parameters[attr].sequence_parallel = sequence_parallel
    return op, params
