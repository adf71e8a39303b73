"""The composed Hydra config dict -> :class:`tp_fuse.launch.config.TrainConfig`, once.

:func:`from_dict` checks every key and type against the dataclasses' annotations (an
unknown key gets the closest known one as a hint, a wrong literal the closest allowed
value) and reads ``+model=hf``'s sizes from the model directory's config.json;
:func:`check_plan` checks ``model.plan`` before any process starts. Cross-field
constraints are :mod:`tp_fuse.launch.config_validate`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

from tp_fuse.layers.config import GPTConfig
from tp_fuse.layers.wrap.convert import PLAN_STYLES
from tp_fuse.layers.wrap.hf_plans import FAMILIES
from tp_fuse.safe_yaml import read_yaml_file

from .config import MEGATRON_SPECS, SECTIONS, ModelConfig, TrainConfig
from .models.hf_config import gpt_fields, needs_plan
from .models.hf_plan import is_plan_object, load_plan_object

__all__ = ["check_plan", "from_dict"]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _string_literals(tp: Any) -> list[str]:
    """The string values a ``Literal`` (possibly inside a ``Union``) allows."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return [a for a in typing.get_args(tp) if isinstance(a, str)]
    if origin in (Union, types.UnionType):
        return [v for a in typing.get_args(tp) for v in _string_literals(a)]
    return []


def _literal_hint(value: Any, tp: Any) -> str:
    """``; did you mean 'delayed'?`` for a string close to one of ``tp``'s literals, else empty."""
    if not isinstance(value, str):
        return ""
    guess = difflib.get_close_matches(value, _string_literals(tp), n=1, cutoff=0.6)
    return f"; did you mean {guess[0]!r}?" if guess else ""


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """``value`` checked (and, for int->float, converted) against annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        # Compare types too: True == 1 must not select a Literal[1].
        if any(type(value) is type(a) and value == a for a in typing.get_args(tp)):
            return value
        raise ValueError(f"{name}: expected one of {_type_name(tp)}, got {value!r}{_literal_hint(value, tp)}")
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, name)
            except ValueError:
                continue
        raise ValueError(f"{name}: expected {_type_name(tp)}, got {value!r}{_literal_hint(value, tp)}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(f"{name}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        # bool is an int subclass; `tp=true` is a mistake, not a size of 1.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{name}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {tp!r} for {name}")


def _did_you_mean(prefix: str, name: str, known: list[str]) -> str:
    """``; did you mean <prefix>.<closest known key>?`` (empty when nothing is close)."""
    guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {prefix}.{guess[0]}?" if guess else ""


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{prefix}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)}; "
            f"known keys of {prefix}: {', '.join(known)}" + _did_you_mean(prefix, unknown[0], known)
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from the composed (resolved) Hydra config dict.

    Raises ValueError naming the field for a missing model, unknown keys or bad types.
    """
    data = dict(data)
    data.pop("hydra", None)
    if "model" not in data or data["model"] is None:
        raise ValueError("model: no model selected; add +model=gpt (or gpt-125m, gpt-350m, llama, ...)")
    model = dict(data.pop("model"))
    name = model.pop("name", "gpt")
    if not isinstance(name, str):
        raise ValueError(f"model.name: expected a string, got {name!r}")
    path = model.pop("path", None)
    spec = model.pop("spec", "local")
    if spec != "local" and name != "megatron_gpt":
        raise ValueError(f"model.spec: only +model=megatron_gpt takes a layer spec (model.name is {name!r})")
    if spec not in MEGATRON_SPECS:
        raise ValueError(f"model.spec: expected one of {', '.join(MEGATRON_SPECS)}, got {spec!r}")
    verify = True
    plan = None
    if name == "hf":
        verify = model.pop("verify", True)
        if not isinstance(verify, bool):
            raise ValueError(f"model.verify: expected true or false, got {verify!r}")
        plan = check_plan(model.pop("plan", None))
        extra = sorted(model)
        if extra:
            raise ValueError(f"unknown key(s) {', '.join(f'model.{k}' for k in extra)}: +model=hf takes model.path, "
                             f"model.verify and model.plan (the sizes come from the directory's config.json)")
        gpt = GPTConfig(**gpt_fields(path))
        family = needs_plan(path)
        if family is not None and plan is None:
            raise ValueError(f"model.plan: wrap has no built-in plan for model_type {family!r} ({path}); give one: "
                             f"model.plan=<module>:<attribute> naming a {{module glob: style}} mapping (FusedColumn "
                             f"for fused projections) or a plan(config) function in your Python code, or a .yaml "
                             f"file of {{module glob: style}}")
    else:
        if path is not None:
            raise ValueError(f"model.path: only +model=hf takes a model directory (model.name is {name!r})")
        if model.pop("plan", None) is not None:
            raise ValueError(f"model.plan: only +model=hf takes a wrap plan (model.name is {name!r}; tp-fuse's "
                             f"own models are built sharded)")
        gpt = _build(GPTConfig, model, "model")
    sections = SECTIONS
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(
            f"unknown top-level key(s) {', '.join(unknown)}; known: model, {', '.join(sections)}"
        )
    built = {k: _build(cls, data[k] if data.get(k) is not None else {}, k) for k, cls in sections.items()}
    return TrainConfig(model=ModelConfig(name=name, gpt=gpt, path=path, verify=verify, plan=plan, spec=spec),
                       **built)


def check_plan(plan: Any) -> Union[None, str, dict[str, str]]:
    """``model.plan`` for ``+model=hf``, checked before any process starts: None, the name
    of a built-in plan, or a ``{module glob: style}`` mapping of strings; ValueError
    listing what is available otherwise."""
    if plan is None:
        return None
    if isinstance(plan, str) and plan.endswith((".yaml", ".yml")):
        # Hydra's override grammar cannot spell glob keys ("*", "."), so on the command
        # line a mapping comes as a YAML file: read as plain data, bounded (tp_fuse.safe_yaml).
        try:
            loaded = read_yaml_file(plan, "model.plan: plan file")
        except OSError as e:
            raise ValueError(f"model.plan: cannot read the plan file {plan}: {e.strerror or e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"model.plan: {plan} must hold a YAML mapping {{module glob: style}}, got "
                             f"{type(loaded).__name__}")
        plan = loaded
    if is_plan_object(plan):
        load_plan_object(plan)  # importable, and the attribute a mapping or a callable
        return plan
    if isinstance(plan, str):
        if plan not in FAMILIES:
            raise ValueError(f"model.plan: no built-in wrap plan named {plan!r}; available: {', '.join(sorted(FAMILIES))} "
                             f"(or a .yaml file holding a mapping {{module glob: style}} with styles "
                             f"{', '.join(PLAN_STYLES)}, or <module>:<attribute> naming such a mapping or "
                             f"a plan(config) function in your Python code; "
                             f"leave it unset for config.json's model_type)")
        return plan
    if isinstance(plan, dict) and plan:
        for glob, style in plan.items():
            if not isinstance(glob, str) or not glob:
                raise ValueError(f"model.plan: keys must be module-name globs (non-empty strings), got {glob!r}")
            if style not in PLAN_STYLES:
                raise ValueError(f"model.plan[{glob!r}]: unknown style {style!r}; expected one of "
                                 f"{', '.join(PLAN_STYLES)} (fused projections need the Python API's FusedColumn, "
                                 f"or a built-in plan by name: {', '.join(sorted(FAMILIES))})")
        return dict(plan)
    raise ValueError(f"model.plan: expected the name of a built-in plan ({', '.join(sorted(FAMILIES))}) or a "
                     f"non-empty mapping {{module glob: style}}, got {plan!r}")
