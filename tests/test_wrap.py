"""``tp_fuse.layers.wrap`` (gloo, CPU, 2 ranks): models keep their outputs and gradients.

* a model written against Megatron's tensor-parallel layer interface, with this file's own
  implementation of that interface (plain torch autograd functions, independent of
  tp-fuse) -- SP on and off, every flag (``skip_bias_add``, ``gather_output``,
  ``input_is_parallel=False``);
* the same with real ``megatron.core`` layers (skipped with the reason when absent). On
  CPU only megatron-core's plain column/row paths run: 0.16.1 allocates the buffers of its
  sequence-parallel all-gather, ``gather_output`` and ``input_is_parallel=False`` paths
  with ``torch.cuda.current_device()``. Those paths are covered by the fixture, which is
  checked against megatron-core on the common paths;
* a plain ``nn.Linear`` / ``nn.LayerNorm`` model converted by a plan, against the
  unsharded model on full inputs;
* FP8 through ``wrap(fp8=...)``; one ``ValueError`` listing every problem.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import case_values, run_cases, run_distributed

pytestmark = pytest.mark.multirank

S, B, H, FFN = 8, 2, 16, 32
# find_spec("megatron.core") raises (not None) when the megatron namespace is absent.
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


# ---- a minimal, independent implementation of Megatron's TP layer interface -------------


class _Copy(torch.autograd.Function):
    """identity / all-reduce(dy)"""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None


class _Reduce(torch.autograd.Function):
    """all-reduce / identity"""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        return dy, None


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _Gather(torch.autograd.Function):
    """all-gather along ``dim`` / this rank's slice of dy, summed over ranks if ``reduce``"""

    @staticmethod
    def forward(ctx, x, group, dim, reduce):  # noqa: ANN001
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        if ctx.reduce:  # the gathered activation fed rank-local GEMMs: sum their dgrads
            dy = dy.clone()
            dist.all_reduce(dy, group=ctx.group)
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return dy.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """reduce-scatter along dim 0 / all-gather"""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        return _gather(dy, ctx.group, 0), None


class _Scatter(torch.autograd.Function):
    """this rank's slice of the last dim / all-gather along the last dim"""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        ctx.group = group
        return x.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        return _gather(dy, ctx.group, -1), None


def _full_weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.2


class MegatronStyleColumn(nn.Module):
    """Megatron's ColumnParallelLinear interface: returns ``(output, bias_or_None)``."""

    def __init__(self, input_size, output_size, *, tp_group, bias=True, gather_output=False,  # noqa: ANN001
                 skip_bias_add=False, sequence_parallel=False, seed=0):
        super().__init__()
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size // tp
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        self.weight = nn.Parameter(_full_weight(output_size, input_size, seed).chunk(tp)[rank].clone())
        full_bias = torch.linspace(-0.5, 0.5, output_size)
        self.bias = nn.Parameter(full_bias.chunk(tp)[rank].clone()) if bias else None

    def forward(self, x, weight=None, runtime_gather_output=None):  # noqa: ANN001
        if self.sequence_parallel:
            # Backward: each rank's dgrad is partial -> reduce-scatter (sum, keep my rows).
            x = _Gather.apply(x, self.tp_group, 0, True)
        else:
            x = _Copy.apply(x, self.tp_group)
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            y = _Gather.apply(y, self.tp_group, -1, False)
        return y, (self.bias if self.skip_bias_add else None)


class MegatronStyleRow(nn.Module):
    """Megatron's RowParallelLinear interface: returns ``(output, bias_or_None)``."""

    def __init__(self, input_size, output_size, *, tp_group, bias=True, input_is_parallel=True,  # noqa: ANN001
                 skip_bias_add=False, sequence_parallel=False, seed=0):
        super().__init__()
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // tp
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        self.weight = nn.Parameter(_full_weight(output_size, input_size, seed).chunk(tp, dim=1)[rank].clone())
        self.bias = nn.Parameter(torch.linspace(-0.3, 0.3, output_size)) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x):  # noqa: ANN001
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.tp_group)
        y = F.linear(x, self.weight)
        y = _ReduceScatter.apply(y, self.tp_group) if self.sequence_parallel else _Reduce.apply(y, self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            y = y + self.bias
        return y, (self.bias if self.skip_bias_add else None)


class MegatronStyleModel(nn.Module):
    """A pre-norm MLP block plus a head, written against the Megatron TP interface.

    ``column`` / ``row`` build the layers (this file's classes, or megatron.core's).
    ``gathering_head`` adds a column layer with ``gather_output=True`` feeding a row layer
    with ``input_is_parallel=False`` (megatron-core runs those two paths only on CUDA).
    """

    def __init__(self, column: Callable[..., nn.Module], row: Callable[..., nn.Module], sp: bool,
                 gathering_head: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = column(H, FFN, skip_bias_add=True, seed=1)
        self.fc2 = row(FFN, H, input_is_parallel=True, seed=2)
        self.head = column(H, FFN, gather_output=True, seed=3) if gathering_head else None
        self.back = row(FFN, H, input_is_parallel=False, seed=4) if gathering_head and not sp else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, b = self.fc1(self.norm(x))
        z, none = self.fc2(F.gelu(y + b, approximate="tanh"))
        assert none is None
        x = x + z
        if self.head is None:
            return x, y
        h, _ = self.head(x)  # [s, b, FFN]: full features on every rank
        if self.back is not None:
            x = x + self.back(h)[0]
        return x, h


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_()
    outs = model(x)
    gen = torch.Generator().manual_seed(5)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], x.grad


def _input(rank: int, world: int, sp: bool) -> torch.Tensor:
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(11))
    return x.chunk(world)[rank].contiguous() if sp else x


def _before_after(model: nn.Module, group, x: torch.Tensor, **wrap_kwargs: Any) -> dict[str, Any]:
    from tp_fuse.layers import wrap

    params_before = dict(model.named_parameters())
    outs_ref, dx_ref = _step(model, x)
    grads_ref = _grads(model)
    model.zero_grad(set_to_none=True)
    wrap(model, group, **wrap_kwargs)
    outs, dx = _step(model, x)
    grads = _grads(model)  # parameter names are the original model's (issue 10.7)
    same_objects = all(any(p is q for q in model.parameters()) for p in params_before.values())
    diffs = {f"out{i}": (o - r).abs().max().item() for i, (o, r) in enumerate(zip(outs, outs_ref))}
    diffs["dx"] = (dx - dx_ref).abs().max().item()
    assert grads.keys() == grads_ref.keys(), (sorted(grads), sorted(grads_ref))
    diffs.update({f"grad:{n}": (grads[n] - g).abs().max().item() for n, g in grads_ref.items()})
    types = {n: type(m).__name__ for n, m in model.named_children()}
    return {"diffs": diffs, "same_objects": same_objects, "types": types, "tuple": isinstance(outs, list)}


@case
def megatron_style_fixture(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world)))
    out = {}
    for sp in (False, True):
        column = lambda *a, **k: MegatronStyleColumn(*a, tp_group=group, sequence_parallel=sp, **k)  # noqa: E731
        row = lambda *a, **k: MegatronStyleRow(*a, tp_group=group, sequence_parallel=sp, **k)  # noqa: E731
        model = MegatronStyleModel(column, row, sp)
        out[f"sp={sp}"] = _before_after(model, group, _input(rank, world, sp))
    return out


def _megatron_core_layers(group, sp: bool):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=dist.get_world_size(group), sequence_parallel=sp,
                                 use_cpu_initialization=True, params_dtype=torch.float32)

    def init_for(seed: int):
        def init(w: torch.Tensor) -> None:  # Megatron calls it on the full master weight
            with torch.no_grad():
                w.copy_(_full_weight(*w.shape, seed))
        return init

    def column(in_f, out_f, *, seed, **kw):  # noqa: ANN001, ANN003
        layer = ColumnParallelLinear(in_f, out_f, config=config, init_method=init_for(seed), bias=True,
                                     tp_group=group, **kw)
        with torch.no_grad():
            layer.bias.copy_(torch.linspace(-0.5, 0.5, out_f).chunk(dist.get_world_size(group))[dist.get_rank(group)])
        return layer

    def row(in_f, out_f, *, seed, input_is_parallel, **kw):  # noqa: ANN001, ANN003
        layer = RowParallelLinear(in_f, out_f, config=config, init_method=init_for(seed), bias=True,
                                  input_is_parallel=input_is_parallel, skip_bias_add=False, tp_group=group, **kw)
        with torch.no_grad():
            layer.bias.copy_(torch.linspace(-0.3, 0.3, out_f))
        return layer

    return column, row


@case
def megatron_core_layers(rank: int, world: int) -> dict[str, Any]:
    if not HAVE_MEGATRON:
        return {"skipped": "megatron.core is not installed"}
    group = dist.new_group(list(range(world)))
    column, row = _megatron_core_layers(group, sp=False)
    model = MegatronStyleModel(column, row, sp=False, gathering_head=False)
    result = _before_after(model, group, _input(rank, world, False))
    # The fixture and megatron-core agree on the same weights (the fixture is a faithful oracle).
    fixture = MegatronStyleModel(
        lambda *a, **k: MegatronStyleColumn(*a, tp_group=group, **k),
        lambda *a, **k: MegatronStyleRow(*a, tp_group=group, **k), sp=False, gathering_head=False)
    outs_fixture, _ = _step(fixture, _input(rank, world, False))
    outs_wrapped, _ = _step(model, _input(rank, world, False))
    result["vs_fixture"] = max((a - b).abs().max().item() for a, b in zip(outs_fixture, outs_wrapped))
    return result


class PlainBlock(nn.Module):
    """A single-device pre-norm MLP block from plain torch modules."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


PLAN = {"norm": "sequence_parallel", "fc1": "column", "fc2": "row"}


@case
def plain_model_with_plan(rank: int, world: int) -> dict[str, float]:
    from tp_fuse.layers import wrap

    group = dist.new_group(list(range(world)))
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)  # identical full weights on every rank
        ref = PlainBlock()
        with torch.no_grad():
            ref.norm.weight.add_(0.1)
            ref.norm.bias.add_(0.1)
        model = wrap(copy.deepcopy(ref), group, plan=PLAN, sequence_parallel=sp)
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
        x_ref = x.clone().requires_grad_()
        y_ref = ref(x_ref)
        dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
        y_ref.backward(dy)
        rows = slice(rank * S // world, (rank + 1) * S // world) if sp else slice(None)
        x_local = x[rows].clone().requires_grad_()
        y = model(x_local)
        y.backward(dy[rows])
        f = FFN // world
        pairs = {
            "y": (y, y_ref[rows]),
            "dx": (x_local.grad, x_ref.grad[rows]),
            "fc1.weight": (model.fc1.weight.grad, ref.fc1.weight.grad[rank * f:(rank + 1) * f]),
            "fc1.bias": (model.fc1.bias.grad, ref.fc1.bias.grad[rank * f:(rank + 1) * f]),
            "fc2.weight": (model.fc2.weight.grad, ref.fc2.weight.grad[:, rank * f:(rank + 1) * f]),
            "fc2.bias": (model.fc2.bias.grad, ref.fc2.bias.grad),
            "norm.weight": (model.norm.weight.grad, ref.norm.weight.grad),
        }
        for key, (a, b) in pairs.items():
            out[f"sp={sp}/{key}"] = ((a - b).abs().max() / b.abs().max()).item()
        out[f"sp={sp}/returns_tensor"] = float(isinstance(y, torch.Tensor))
    return out


@case
def fp8_through_wrap(rank: int, world: int) -> dict[str, Any]:
    from tp_fuse.layers import wrap
    from tp_fuse.recipe import DelayedScaling

    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    ref = PlainBlock()
    model = wrap(copy.deepcopy(ref), group, plan=PLAN, fp8=DelayedScaling(), fp8_group=group)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    calls: list[tuple[int, Any]] = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        calls.append((tensor.numel(), kwargs.get("op", args[0] if args else None)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for _ in range(2):
            y = model(x)
            y.sum().backward()
    finally:
        dist.all_reduce = original
    scales = torch.stack([q.scale for m in model.modules() if type(m).__name__ == "BasicLinear"
                          for q in m._quantizers.quantizers.values()])
    y_ref = ref(x)
    return {
        "max_calls": [n for n, op in calls if op == dist.ReduceOp.MAX],
        "scales": _gather(scales[None], group, 0),
        "rel_err_vs_fp32": ((y - y_ref).abs().max() / y_ref.abs().max()).item(),
    }


@case
def problems_are_listed_together(rank: int, world: int) -> dict[str, str]:
    from tp_fuse.layers import wrap

    group = dist.new_group(list(range(world)))
    messages = {}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(H)
            self.fc1 = nn.Linear(H, 7)
            self.fc2 = nn.Linear(7, H)
            self.act = nn.GELU()

    torch.manual_seed(0)
    try:
        wrap(Model(), group, plan={"fc1": "column", "fc2": "diagonal", "act": "row", "norm": "column",
                                   "decoder.*": "row"})
        messages["plan"] = "no error"
    except ValueError as e:
        messages["plan"] = str(e)
    torch.manual_seed(rank)  # different weights on each rank
    try:
        wrap(PlainBlock(), group, plan=PLAN)
        messages["replicated"] = "no error"
    except ValueError as e:
        messages["replicated"] = str(e)
    try:
        torch.manual_seed(0)
        col = MegatronStyleColumn(H, FFN, tp_group=group)
        col.is_expert = True
        col.sequence_parallel = False
        holder = nn.Sequential(col)
        wrap(holder, group, sequence_parallel=True)
        messages["megatron"] = "no error"
    except ValueError as e:
        messages["megatron"] = str(e)
    return messages


def _run_all_cases(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    return run_cases(_CASES, rank, world)


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(2, _run_all_cases, timeout=240)


def _check_before_after(result: dict[str, Any], tol: float = 1e-5) -> None:
    assert result["same_objects"], "wrap must keep the Megatron layers' Parameter objects"
    assert result["tuple"]
    assert "MegatronLinearAdapter" in result["types"]["fc1"] and "MegatronLinearAdapter" in result["types"]["fc2"]
    bad = {k: v for k, v in result["diffs"].items() if v > tol}
    assert not bad, f"outputs/grads changed by wrap: {bad}"


def test_megatron_interface_fixture_unchanged_by_wrap(results) -> None:
    for value in case_values(results, "megatron_style_fixture"):
        for sp in (False, True):
            _check_before_after(value[f"sp={sp}"])


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron.core is not installed")
def test_megatron_core_layers_unchanged_by_wrap(results) -> None:
    for value in case_values(results, "megatron_core_layers"):
        _check_before_after(value)
        assert value["vs_fixture"] <= 1e-5


def test_plan_converts_plain_model(results) -> None:
    for value in case_values(results, "plain_model_with_plan"):
        for key, rel in value.items():
            if key.endswith("returns_tensor"):
                assert rel == 1.0, key
            else:
                assert rel <= 1e-5, f"{key}: {rel:.3g}"


def test_fp8_through_wrap_reduces_once_per_direction(results) -> None:
    r0, r1 = case_values(results, "fp8_through_wrap")
    # Two steps: per step one forward (2 GEMMs x input, weight) and one backward (2 x grad_output).
    assert r0["max_calls"] == [4, 2, 4, 2], r0["max_calls"]
    assert torch.equal(r0["scales"][0], r0["scales"][1]), "scales differ across ranks"
    assert r0["rel_err_vs_fp32"] < 0.1


def test_wrap_lists_every_problem_in_one_error(results) -> None:
    r0, _ = case_values(results, "problems_are_listed_together")
    plan = r0["plan"]
    for needle in ("fc1: out_features (7) is not divisible by the TP size (2)",
                   "plan['fc2']: unknown style 'diagonal'",
                   "act: plan style 'row' needs a torch.nn.Linear (or GPT-2 Conv1D), got GELU",
                   "norm: plan style 'column' needs a torch.nn.Linear (or GPT-2 Conv1D), got LayerNorm",
                   "plan['decoder.*']: matches no module"):
        assert needle in plan, f"{needle!r} not in:\n{plan}"
    assert "parameters differ across TP ranks" in r0["replicated"]
    assert "is_expert=True is not supported" in r0["megatron"]
    assert "module has sequence_parallel=False, wrap was asked for True" in r0["megatron"]
