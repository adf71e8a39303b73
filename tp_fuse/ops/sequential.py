"""``Sequential``: a drop-in ``torch.nn.Sequential`` that fuses its ops.

Adjacent :class:`FusibleOperation`s are grouped into one
:class:`OperationFuser` each; any other module splits the groups and runs as
is. Extra inputs (for ops like ``AddExtraInput``) are passed after the main
input, in op order; extra outputs (from ops like ``MakeExtraOutput``) are
returned after the main output: ``y, residual = seq(x)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch

from .explanation import Explanation, FuserExplanation
from .fuser import OperationFuser
from .op import FusibleOperation

_Group = Union[OperationFuser, torch.nn.Module]


class Sequential(torch.nn.Module):
    """Container of modules run in order, fusing adjacent fusible ops.

    Accepts modules positionally or one ``OrderedDict`` of named modules,
    like ``torch.nn.Sequential``.
    """

    def __init__(self, *args: Union[torch.nn.Module, "OrderedDict[str, torch.nn.Module]"]) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, self._checked(module))
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), self._checked(module))
        self.__dict__["_groups"] = None

    @staticmethod
    def _checked(module: Any) -> torch.nn.Module:
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"Sequential takes torch.nn.Module items, got {type(module).__name__}")
        return module

    # ---- nn.Sequential-style container API -------------------------------

    def _invalidate(self) -> None:
        self.__dict__["_groups"] = None

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, idx: Union[int, slice]) -> Union[torch.nn.Module, "Sequential"]:
        modules = list(self._modules.values())
        if isinstance(idx, slice):
            return Sequential(*modules[idx])
        return modules[self._index(idx)]

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        key = list(self._modules.keys())[self._index(idx)]
        self._modules[key] = self._checked(module)
        self._invalidate()

    def __delitem__(self, idx: Union[int, slice]) -> None:
        keys = list(self._modules.keys())
        for key in keys[idx] if isinstance(idx, slice) else [keys[self._index(idx)]]:
            del self._modules[key]
        self._renumber()

    def pop(self, idx: Union[int, slice] = -1) -> Union[torch.nn.Module, "Sequential"]:
        """Remove and return the module at ``idx`` (a ``Sequential`` of them for a slice)."""
        out = self[idx]
        del self[idx]
        return out

    def _index(self, idx: int) -> int:
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for Sequential of length {n}")
        return idx % n

    def _renumber(self) -> None:
        modules = list(self._modules.items())
        self._modules.clear()
        for i, (name, module) in enumerate(modules):
            self._modules[name if not name.isdigit() else str(i)] = module
        self._invalidate()

    def append(self, module: torch.nn.Module) -> "Sequential":
        self.add_module(str(len(self)), self._checked(module))
        self._invalidate()
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        for module in modules:
            self.append(module)
        return self

    def __iadd__(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        """``seq += modules``: append them (the same module objects)."""
        return self.extend(modules)

    def __add__(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        """``seq + modules``: a new Sequential of this one's modules, then ``modules``."""
        out = Sequential()
        out.extend(self)
        out.extend(modules)
        return out

    def insert(self, index: int, module: torch.nn.Module) -> "Sequential":
        modules = list(self._modules.values())
        n = len(modules)
        if not -n <= index <= n:
            raise IndexError(f"index {index} is out of range for Sequential of length {n}")
        modules.insert(index % (n + 1) if index < 0 else index, self._checked(module))
        self._modules.clear()
        for i, m in enumerate(modules):
            self._modules[str(i)] = m
        self._invalidate()
        return self

    # ---- grouping and running --------------------------------------------

    @property
    def _module_groups(self) -> list[_Group]:
        """The groups this container runs, in order: one ``OperationFuser`` per run of
        adjacent fusible ops, other modules as they are (Transformer Engine's attribute;
        built on first use, rebuilt after the container changes)."""
        return self._make_module_groups()

    def _make_module_groups(self) -> list[_Group]:
        groups = self.__dict__["_groups"]
        if groups is not None:
            return groups
        groups = []
        run: list[FusibleOperation] = []
        for module in self._modules.values():
            if isinstance(module, FusibleOperation):
                run.append(module)
                continue
            if run:
                groups.append(OperationFuser(run))
                run = []
            groups.append(module)
        if run:
            groups.append(OperationFuser(run))
        if not torch.compiler.is_compiling():
            # While dynamo traces a first call the groups are built for the trace only:
            # stored, they would fail the graph's guard on this attribute (None when
            # traced) at the next call and recompile once. The compiled graph does not
            # need them; an eager call builds and stores them.
            self.__dict__["_groups"] = groups
        return groups

    def forward(
        self,
        input_: torch.Tensor,
        *extra_inputs: torch.Tensor,
        op_kwargs: Optional[dict[FusibleOperation, dict[str, Any]]] = None,
    ):
        """Run the groups in order. ``op_kwargs`` (Transformer Engine's): per basic op,
        keyword arguments for that op in this call (e.g. ``GroupedLinear``'s caller
        buffers), keyed by the op object."""
        groups = self._make_module_groups()
        needed = sum(g.num_extra_inputs for g in groups if isinstance(g, OperationFuser))
        if len(extra_inputs) != needed:
            raise ValueError(
                f"Sequential expects {needed} extra input(s) after the main input "
                f"(one per AddExtraInput-style op), got {len(extra_inputs)}"
            )
        fusers = [g for g in groups if isinstance(g, OperationFuser)]
        if op_kwargs:
            known = {id(op) for g in fusers for op in g.basic_ops}
            for op in op_kwargs:
                if id(op) not in known:
                    raise ValueError(
                        f"Sequential op_kwargs: keys must be basic ops of this Sequential, got "
                        f"{type(op).__name__} (a composite op such as Linear: key its basic ops)"
                    )
        x = input_
        remaining = list(extra_inputs)
        extra_outputs: list[torch.Tensor] = []
        for group in groups:
            if not isinstance(group, OperationFuser):
                x = group(x)
                continue
            n_in = group.num_extra_inputs
            group_inputs, remaining = remaining[:n_in], remaining[n_in:]
            kwargs = None
            if op_kwargs and any(op in op_kwargs for op in group.basic_ops):
                kwargs = [dict(op_kwargs.get(op, {})) for op in group.basic_ops]
            result = group(x, *group_inputs, basic_op_kwargs=kwargs)
            if group.num_extra_outputs:
                x, *outs = result
                extra_outputs.extend(outs)
            else:
                x = result
        if extra_outputs:
            return (x, *extra_outputs)
        return x

    # ---- explain ---------------------------------------------------------

    def explain_groups(self) -> list[tuple[str, Any]]:
        """``(label, FuserExplanation | module name)`` for each group."""
        out: list[tuple[str, Any]] = []
        for k, group in enumerate(self._make_module_groups()):
            if isinstance(group, OperationFuser):
                out.append((f"group {k}", group.explain()))
            else:
                out.append((f"group {k}", type(group).__name__))
        return out

    def explain(self) -> Explanation:
        """Fusion decisions and reasons under the FP8 recipe in force (``tp_fuse.ops.explain``)."""
        return Explanation.from_groups(self.explain_groups())

    def fuser_explanations(self) -> list[FuserExplanation]:
        return [g for _, g in self.explain_groups() if isinstance(g, FuserExplanation)]

    def fusers(self) -> list[OperationFuser]:
        """The op groups (created on demand), e.g. for tests asserting fusions."""
        return [g for g in self._make_module_groups() if isinstance(g, OperationFuser)]
