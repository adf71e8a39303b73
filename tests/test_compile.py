"""``trainer.compile=true``: torch.compile'd TransformerLayers train like eager ones.

One small run (compiling is slow on 2 CPU cores). The tp-fuse fusion groups are graph
breaks by design (``OperationFuser.__call__`` is ``torch.compiler.disable``d, see
docs/fsdp.md); the rest of each layer is compiled -- checked through dynamo's counters.
"""

from __future__ import annotations

import torch
import torch._dynamo

from tp_fuse.launch.api import train
from tolerances import tols

RUN = [
    "+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
    "trainer.global_batch_size=4", "trainer.micro_batch_size=4", "trainer.max_steps=2", "trainer.log_interval=1",
    "trainer.val_interval=0", "logger=none", "trainer.progress=false", "checkpoint.save_final=false",
]


def test_compiled_layers_train_like_eager(tmp_path) -> None:
    eager = train(RUN, str(tmp_path / "eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train([*RUN, "trainer.compile=true"], str(tmp_path / "compiled"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    breaks = " ".join(torch._dynamo.utils.counters["graph_break"])
    assert "OperationFuser.__call__" in breaks  # the documented graph break
    assert sorted(compiled.losses) == [1, 2]
    for step, loss in eager.losses.items():
        assert abs(compiled.losses[step] - loss) <= tols(torch.float32)["atol"], (step, compiled.losses, eager.losses)
