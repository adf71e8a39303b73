"""What ``trainer.compile=true`` cost in one run: graphs, graph breaks, compile time.

torch.compile's own counters (``torch._dynamo.utils.counters``, per process) and compile
timings (``torch._dynamo.utils.compilation_time_metrics``) cover every compile of the
process; a run reads them when it starts (:meth:`CompileStats.start`) and reports the
difference at its end (the summary's ``torch.compile`` line), so in-process runs (tests,
notebooks) each see their own. Graphs: one per compiled code and guard set -- the
TransformerLayers share one without tensor-parallel comm/GEMM windows (one each with
them: ``tp_fuse.launch.models.build.compile_layers``); validation's no-grad forward and a
last batch of another size compile their own. Only imported when compiling.
"""

from __future__ import annotations

import dataclasses

import torch._dynamo

__all__ = ["CompileStats"]

# dynamo's timer of one frame's compile (tracing, AOTAutograd, inductor) in
# compilation_time_metrics; backward graphs compile in their first backward, under
# the same timer's AOT part.
_FRAME_TIMER = "_compile.compile_inner"


def _totals() -> tuple[int, int, float]:
    counters = torch._dynamo.utils.counters
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = int(sum(counters["graph_break"].values()))
    seconds = float(sum(torch._dynamo.utils.compilation_time_metrics.get(_FRAME_TIMER, [])))
    return graphs, breaks, seconds


@dataclasses.dataclass
class CompileStats:
    """This run's share of the process's torch.compile counters (see the module doc)."""

    graphs0: int = 0
    breaks0: int = 0
    seconds0: float = 0.0

    @classmethod
    def start(cls) -> "CompileStats":
        """Read the counters as the run starts compiling."""
        return cls(*_totals())

    def line(self) -> str:
        """``3 graphs, 0 graph breaks, 9.8 s compiling`` since :meth:`start`."""
        graphs, breaks, seconds = _totals()
        graphs, breaks, seconds = graphs - self.graphs0, breaks - self.breaks0, seconds - self.seconds0
        return (f"{graphs} graph{'s' if graphs != 1 else ''}, {breaks} graph break{'s' if breaks != 1 else ''}, "
                f"{seconds:.1f} s compiling (dynamo, AOTAutograd, inductor; inside the first steps' time)")
