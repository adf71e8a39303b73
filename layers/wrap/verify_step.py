"""``wrap()``'s verification step: which probe, whether it runs, what it cost, what it found.

``wrap`` verifies by default (issue 39): whenever it shards anything (TP size > 1 and at
least one module converted), the wrapped model is compared with the original on a probe
(``tp_fuse.layers.wrap.verify``):

* ``verify=None`` (the default): the automatic probe of a model that takes token ids
  (``[2, 8]`` random ids: a Hugging Face causal LM, the launcher's probe, or a forward
  whose first parameter is ``idx`` / ``tokens`` / ``input_ids``, as nanoGPT's and
  torchtitan's; ``tp_fuse.layers.wrap.probe``). A model without one (a plain torch model
  on activations, a megatron-core ``GPTModel``) is not verified, with a warning that says
  how to give a probe; so is a model whose automatic probe fails on the original (its
  forward needs other inputs).
* ``verify=<probe>`` (``True``, a tensor, a tuple, a dict, a callable): that probe; its
  failure on the original model is an error.
* ``verify=False``: an explicit opt-out, with a warning naming what is then not checked.

At TP size 1 nothing is sharded, so the default does not verify (nothing to compare).

The cost is measured and reported (``WrapReport.verified``, ``WrapReport.verify_seconds``):
the seconds of the reference backward and of the wrapped model's forward, backward and
comparison (the original's probe forward is traced anyway, verification or not), the
gradient bytes held per rank between the two passes, and the all-gathers.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from .report import WrapReport
from .probe import WHO_GETS_ONE, auto_probe, make_probe
from .verify import Reference, compare

__all__ = ["ProbeChoice", "choose_probe", "check_verify_arg", "finish_verification", "warn_unverified",
           "VERIFY_ERROR"]

#: The start of the error a failing verification raises.
VERIFY_ERROR = ("wrap(verify=...): the wrapped model does not match the original on the probe (the model has been "
                "converted; rebuild it):\n  - ")
# What verification checks that nothing else does (named by the warnings when it does not run).
_UNCHECKED = ("the wrapped model's outputs and gradients are NOT compared with the original's, so a plan that "
              "runs but computes wrong numbers (a fused projection split as a plain column, fused parts in the "
              "wrong order, a head count or per-head tensor the model keeps elsewhere) is not caught")


@dataclasses.dataclass
class ProbeChoice:
    """The probe ``wrap`` verifies (and traces) with.

    Attributes:
        probe: ``f(model) -> output``, or None (no verification).
        strict: the caller gave the probe: its failure on the original is an error (the
            default automatic probe falls back to not verifying, with a warning).
        unverified: why the model is not verified (None when it is, or when nothing is
            sharded).
    """

    probe: Optional[Callable[[torch.nn.Module], Any]]
    strict: bool
    unverified: Optional[str] = None


def check_verify_arg(model: torch.nn.Module, verify: Any) -> None:
    """A ``verify=`` that cannot be a probe is a ``ValueError`` before anything else."""
    if verify is not None and verify is not False:
        make_probe(model, verify)


def choose_probe(model: torch.nn.Module, verify: Any, converts: bool, tp: int) -> ProbeChoice:
    """The probe for ``wrap(verify=verify)`` of a model of which ``converts`` says whether
    any module is converted, at TP size ``tp``."""
    if verify is False:
        why = "verify=False" if converts and tp > 1 else None
        return ProbeChoice(None, False, why)
    if verify is not None:
        return ProbeChoice(make_probe(model, verify), True)
    if not converts or tp == 1:
        return ProbeChoice(None, False)
    probe = auto_probe(model)
    if probe is None:
        return ProbeChoice(None, False, f"no automatic probe for {type(model).__name__} (only {WHO_GETS_ONE} get "
                                        f"one)")
    return ProbeChoice(probe, False)


def warn_unverified(why: str, converted: int) -> None:
    """The warning for a wrap that shards ``converted`` modules without verifying them."""
    if why == "verify=False":
        text = (f"wrap(verify=False): {converted} converted module(s) are not verified: {_UNCHECKED}. Leave "
                f"verify at its default to check them")
    else:
        text = (f"wrap: {converted} converted module(s) are not verified ({why}): {_UNCHECKED}. Pass "
                f"verify=<input tensor | tuple of args | dict of kwargs | callable(model) -> output> to check them, "
                f"or verify=False to say that you do not want to")
    warnings.warn(text, UserWarning, stacklevel=3)


def finish_verification(model: torch.nn.Module, reference: Reference, probe: Callable[[torch.nn.Module], Any],
                        tp_group: dist.ProcessGroup, transposed: set[str], report: WrapReport,
                        plan_entries: dict[str, str]) -> None:
    """Compare the wrapped model with ``reference``; raise on a difference, else record
    the verdict and its cost in ``report``. ``plan_entries``: ``{module name: its plan
    entry}`` for naming the entry at fault."""
    start = time.perf_counter()
    found = compare(model, reference, probe, tp_group, transposed, plan_entries)
    seconds = reference.seconds + time.perf_counter() - start
    if found:
        if report.localized:  # what wrap changed on the model besides its projections
            changed = "; ".join(f"{n}: {how}" for n, how in report.localized[:2])
            found.append(f"wrap set attention attributes to this rank's share ({changed}"
                         f"{'; ...' if len(report.localized) > 2 else ''}): a model that reads one as something "
                         f"else (CodeGen's embed_dim sets the block size of its fused qkv) needs it back, with "
                         f"wrap(fixup=f), f(model, tp_size) run after conversion")
        raise ValueError(VERIFY_ERROR + "\n  - ".join(found))
    held = sum(g.numel() * g.element_size() for g in reference.grads.values() if g is not None)
    gathers = sum(1 for name, p in model.named_parameters() if reference.params.get(name) != id(p)
                  and getattr(p, "tp_shard", None) is not None)
    report.verify_seconds = seconds
    report.verified = (f"outputs and every gradient match the original on the probe (cost {seconds:.2f} s: a "
                       f"backward of the original, a forward and backward of the wrapped model, "
                       f"{held / 2**20:.1f} MiB of gradients held, {gathers} sharded gradients gathered)")
