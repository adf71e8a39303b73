"""``DebugSession``: a debug feature config bound to a model, with its own state.

Transformer Engine keeps this in a process-global ``debug_api``; here it is an
object you create, attach and step (several sessions on several models do not
interfere)::

    session = DebugSession("features.yaml")          # or a dict
    session.attach(model, tp_group=tp_group)         # before the first forward pass
    for step in ...:
        loss = model(x); loss.backward(); opt.step()
        session.step()                               # iteration += 1
        if step % 10 == 0:
            for iteration, stats in session.collect():   # collective over the group
                log(stats, step=iteration)

Attach before the first forward: fusion decisions are made at the first call, and
a layer with features must be left unfused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .config import Section, load_debug_config
from .features import BUILTIN_FEATURES, DebugFeature
from .naming import hooks_for, name_linears
from .stats import StatsBuffer

__all__ = ["DebugSession"]


class DebugSession:
    """Debug features for one model.

    Args:
        config: YAML path or mapping (see :mod:`tp_fuse.debug.config`).
        feature_classes: feature name -> class; defaults to the built-ins
            (LogTensorStats, LogFp8TensorStats, DisableFP8GEMM, FakeQuant). Pass your
            own :class:`~tp_fuse.debug.features.DebugFeature` subclasses here.
        iteration: starting iteration (e.g. the resumed step).
        reduction_group: group over which statistics are combined in :meth:`collect`
            (None: the default group when ``torch.distributed`` is initialized).

    Attributes:
        iteration: the value passed to feature calls; :meth:`step` increments it.
        stats: the session's :class:`StatsBuffer`.
        layers: layer name -> hooks, for the layers with features (after :meth:`attach`).
    """

    def __init__(
        self,
        config: Union[str, os.PathLike, dict[str, Any]],
        *,
        feature_classes: Optional[dict[str, type[DebugFeature]]] = None,
        iteration: int = 0,
        reduction_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.sections: list[Section] = load_debug_config(config)
        classes = dict(BUILTIN_FEATURES if feature_classes is None else feature_classes)
        self.stats = StatsBuffer()
        self.features: dict[str, DebugFeature] = {}
        for section in self.sections:
            for fname, spec in section.features.items():
                if fname not in classes:
                    raise ValueError(f"{spec.where}: unknown feature {fname!r}; known: {sorted(classes)}")
                if fname not in self.features:
                    self.features[fname] = classes[fname](self.stats)
                self.features[fname].validate(spec)
        self.iteration = iteration
        self.reduction_group = reduction_group
        self.layers: dict[str, Any] = {}
        self.is_paused = False

    def feature_names(self) -> list[str]:
        """Names of the features some section enables."""
        return sorted(self.features)

    def attach(self, model: torch.nn.Module, *, tp_group: Optional[dist.ProcessGroup] = None) -> list[str]:
        """Give every matching ``BasicLinear`` of ``model`` its features.

        Returns the names of the layers that got features. ValueError when a section
        matches no layer (the message lists the layer names), or when two sections
        give one layer the same feature.
        """
        linears = name_linears(model)
        all_names = [n.layer_name for n in linears]
        for section in self.sections:
            if section.features and not any(section.matches(n) for n in all_names):
                raise ValueError(
                    f"debug config section {section.name!r} matches no layer; layer names are: "
                    + ", ".join(all_names)
                )
        enabled = []
        for name in linears:
            specs = []
            for section in self.sections:
                if not section.matches(name.layer_name):
                    continue
                for fname, spec in section.features.items():
                    if any(s.name == fname for _, s in specs):
                        raise ValueError(
                            f"layer {name.layer_name}: feature {fname} enabled by more than one section"
                        )
                    specs.append((self.features[fname], spec))
            if not specs:
                continue
            hooks = hooks_for(name, tp_group)
            if hooks.uses_debug_api:
                raise ValueError(f"layer {name.layer_name}: already routed through nvdlfw_inspect's debug API; "
                                 "a layer takes either a DebugSession or the debug API, not both")
            hooks.session = self
            hooks.features = specs
            self.layers[name.layer_name] = hooks
            enabled.append(name.layer_name)
        return enabled

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, no feature is called: layers compute as if they had none (e.g. for an
        evaluation pass that should neither be logged nor modified)."""
        previous, self.is_paused = self.is_paused, True
        try:
            yield
        finally:
            self.is_paused = previous

    def step(self) -> None:
        """End of an iteration (TE's ``debug_api.step()``)."""
        self.iteration += 1

    def collect(self) -> list[tuple[int, dict[str, float]]]:
        """Reduce and return the statistics recorded since the last call.

        Collective over ``reduction_group``: every rank calls it at the same point.
        Returns ``[(iteration, {"debug/<layer>/<tensor>/<stat>": value})]``.
        """
        return self.stats.collect(self.reduction_group)
