"""FP8 state of an op in its ``state_dict`` (``_extra_state``), without pickle.

Transformer Engine keeps an op's quantizer state (scales, amax histories) in the
module's ``_extra_state`` so that ``load_state_dict(state_dict())`` resumes training
exactly. Its payload is a pickle; a checkpoint is untrusted input, so here it is a
``uint8`` tensor holding UTF-8 JSON (numbers and base64 of little-endian fp32/int64
arrays). Loading it parses JSON and copies numbers: nothing in it can run code, and
``torch.load(weights_only=True)`` reads it (a plain tensor).

What is stored, per op with quantizers (:class:`QuantizerStateMixin`):

* ``quantizers``: every delayed-scaling quantizer by role (``scale``,
  ``amax_history``, ``last_amax``, ``nonfinite_amax_count``) and the recipe's
  fields, so that a fresh op (never run) can rebuild them. Current scaling keeps no
  state between steps and stores nothing (an empty tensor, as in TE).
* ``params``: for each FP8 parameter (``quantized_model_init``), its quantizer's
  state and the ``scale_inv`` its bytes were written with.

FP8 parameters themselves appear in the state dict as their high-precision master
(a plain tensor): loading copies it into the master, then the extra state (loaded
after the parameters, as ``torch.nn.Module`` does) restores the quantizer and
re-writes the FP8 bytes with the saved ``scale_inv``: the same bytes as saved.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Optional

import torch

from .. import kernels
from ..quantization import DelayedScalingQuantizer, Float8Tensor, is_fp8_parameter
from ..quantization.state_check import check_delayed_state, check_recipe_fields, delayed_state_problem
from ..recipe import DelayedScaling, Format

__all__ = ["QuantizerStateMixin", "FORMAT_NAME"]

FORMAT_NAME = "tp_fuse.op_fp8_state"
_VERSION = 1
_FIELDS = {"scale": torch.float32, "amax_history": torch.float32, "last_amax": torch.float32,
           "nonfinite_amax_count": torch.int64}


def _encode(t: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    t = t.detach().to(device="cpu", dtype=dtype).contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def _decode(obj: Any, dtype: torch.dtype, where: str) -> torch.Tensor:
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), str) or not isinstance(obj.get("shape"), list):
        raise ValueError(f"{where}: expected {{'shape': [...], 'data': base64}}, got {type(obj).__name__}")
    shape = obj["shape"]
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be non-negative ints, got {shape!r}")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: data is not base64 ({e})") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    if len(raw) != numel * itemsize:
        raise ValueError(f"{where}: {len(raw)} bytes for shape {shape} of {dtype}")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return buf.view(dtype).reshape(shape).clone()


def _quantizer_state(q: DelayedScalingQuantizer) -> dict[str, Any]:
    return {name: _encode(getattr(q, name), dtype) for name, dtype in _FIELDS.items()}


def _load_quantizer(q: DelayedScalingQuantizer, state: Any, where: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected an object, got {type(state).__name__}")
    values = {}
    for name, dtype in _FIELDS.items():
        if name not in state:
            raise ValueError(f"{where}: missing field {name!r}")
        t = _decode(state[name], dtype, f"{where}.{name}")
        own = getattr(q, name)
        if t.shape != own.shape:
            raise ValueError(
                f"{where}.{name}: shape {tuple(t.shape)} in the checkpoint, {tuple(own.shape)} here "
                "(a different amax_history_len?)"
            )
        values[name] = t
    # Out-of-range values (inf/0 scales, NaN or 3e38 amaxes, negative counters) would
    # poison a whole history length of steps without an error: refuse them, by key.
    check_delayed_state(values, f"{where}.")
    with torch.no_grad():
        for name, t in values.items():
            getattr(q, name).copy_(t)


def _recipe_fields(recipe: DelayedScaling) -> dict[str, Any]:
    """The recipe as JSON; callables cannot be stored (they are named by None)."""
    algo = recipe.amax_compute_algo
    return {
        "margin": recipe.margin,
        "fp8_format": recipe.fp8_format.name,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": algo if isinstance(algo, str) else None,
        "custom_scaling_factor": recipe.scaling_factor_compute_algo is not None,
        "reduce_amax": recipe.reduce_amax,
    }


def _recipe_from_fields(fields: Any, where: str) -> DelayedScaling:
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: expected an object, got {type(fields).__name__}")
    check_recipe_fields(fields, where)
    if fields.get("amax_compute_algo") is None or fields.get("custom_scaling_factor"):
        raise ValueError(
            f"{where}: the checkpoint's DelayedScaling used a callable, which a checkpoint "
            "cannot carry; run one step under tp_fuse.autocast with that recipe before loading"
        )
    try:
        return DelayedScaling(
            margin=fields["margin"],
            fp8_format=Format[fields["fp8_format"]],
            amax_history_len=fields["amax_history_len"],
            amax_compute_algo=fields["amax_compute_algo"],
            reduce_amax=fields["reduce_amax"],
        )
    except (KeyError, TypeError, ValueError) as e:  # ValueError: DelayedScaling's own checks
        raise ValueError(f"{where}: malformed recipe fields {fields!r} ({e})") from None


class QuantizerStateMixin:
    """``get_extra_state``/``set_extra_state`` and master-copy state dicts for an op
    whose quantizers live in ``self._quantizers`` (an ``OpQuantizers``)."""

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
        # An FP8 parameter is saved as its master (a plain tensor): lossless, and
        # loadable with torch.load(weights_only=True).
        for name, p in self._parameters.items():  # type: ignore[attr-defined]
            if p is not None and is_fp8_parameter(p):
                destination[prefix + name] = p.master if keep_vars else p.master.detach()

    def get_extra_state(self) -> torch.Tensor:
        """A uint8 tensor of JSON with the delayed-scaling state (empty if none)."""
        state: dict[str, Any] = {}
        qs = {r: q for r, q in self._quantizers.quantizers.items() if isinstance(q, DelayedScalingQuantizer)}  # type: ignore[attr-defined]
        if qs:
            recipe = next(iter(qs.values())).recipe
            state["quantizers"] = {
                "recipe": _recipe_fields(recipe),
                "roles": {role: _quantizer_state(q) for role, q in qs.items()},
            }
        params = {}
        for name, p in self._parameters.items():  # type: ignore[attr-defined]
            if p is not None and is_fp8_parameter(p) and isinstance(p.quantizer, DelayedScalingQuantizer):
                params[name] = {"quantizer": _quantizer_state(p.quantizer), "scale_inv": _encode(p._sinv, torch.float32)}
        if params:
            state["params"] = params
        if not state:
            return torch.empty(0, dtype=torch.uint8)
        doc = {"format": FORMAT_NAME, "version": _VERSION, **state}
        return torch.frombuffer(bytearray(json.dumps(doc).encode("utf-8")), dtype=torch.uint8).clone()

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` wrote. Parses JSON only: no code runs."""
        name = type(self).__name__
        if state is None:
            return
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise ValueError(
                f"{name} _extra_state: expected a 1-D uint8 tensor of JSON, got "
                f"{type(state).__name__} {getattr(state, 'dtype', '')}"
            )
        if state.numel() == 0:
            return
        try:
            doc = json.loads(bytes(state.cpu().numpy().tobytes()).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{name} _extra_state: not UTF-8 JSON ({e})") from None
        except RecursionError:  # the C parser recurses per nesting level; a crafted state nests 10**5 deep
            raise ValueError(f"{name} _extra_state: JSON nested too deeply to be FP8 state") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME or doc.get("version") != _VERSION:
            raise ValueError(
                f"{name} _extra_state: expected format {FORMAT_NAME!r} version {_VERSION}, got "
                f"{(doc.get('format'), doc.get('version')) if isinstance(doc, dict) else type(doc).__name__}"
            )
        if "quantizers" in doc:
            self._load_op_quantizers(doc["quantizers"], f"{name} _extra_state.quantizers")
        for pname, pstate in (doc.get("params") or {}).items():
            self._load_param_state(pname, pstate, f"{name} _extra_state.params.{pname}")

    def _load_op_quantizers(self, block: Any, where: str) -> None:
        if not isinstance(block, dict) or not isinstance(block.get("roles"), dict):
            raise ValueError(f"{where}: expected {{'recipe': ..., 'roles': {{...}}}}")
        own = self._quantizers  # type: ignore[attr-defined]
        current = {r: q for r, q in own.quantizers.items() if isinstance(q, DelayedScalingQuantizer)}
        if not current:
            # A fresh op: build its quantizers with the checkpoint's recipe.
            current = own.get(_recipe_from_fields(block.get("recipe"), f"{where}.recipe"))
        for role, qstate in block["roles"].items():
            q = current.get(role)
            if not isinstance(q, DelayedScalingQuantizer):
                raise ValueError(f"{where}.roles: role {role!r} has no delayed-scaling quantizer here")
            _load_quantizer(q, qstate, f"{where}.roles.{role}")

    def _load_param_state(self, pname: str, pstate: Any, where: str) -> None:
        p: Optional[torch.Tensor] = self._parameters.get(pname)  # type: ignore[attr-defined]
        if not (isinstance(p, Float8Tensor) and is_fp8_parameter(p) and isinstance(p.quantizer, DelayedScalingQuantizer)):
            raise ValueError(f"{where}: the checkpoint has FP8 state for {pname!r}, but it is not a "
                             "delayed-scaling FP8 parameter here (build the model inside quantized_model_init)")
        if not isinstance(pstate, dict):
            raise ValueError(f"{where}: expected an object, got {type(pstate).__name__}")
        _load_quantizer(p.quantizer, pstate.get("quantizer"), f"{where}.quantizer")
        scale_inv = _decode(pstate.get("scale_inv"), torch.float32, f"{where}.scale_inv").reshape(())
        problem = delayed_state_problem("scale", scale_inv)  # 1/scale: the same range as a scale
        if problem is not None:
            raise ValueError(f"{where}.scale_inv {problem}")
        with torch.no_grad():
            # The bytes as saved: the master (loaded before the extra state) cast with
            # the scale they were written with. The quantizer's history is untouched.
            scale = torch.reciprocal(scale_inv).to(p.master.device)
            data, _, _ = kernels.quantize(p.master, scale, p.fp8_dtype, with_amax=False)
            p._alias.generation += 1
            p._fp8.copy_(data)
            p._sinv.copy_(scale_inv)
