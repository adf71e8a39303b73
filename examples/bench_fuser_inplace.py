"""Cost of in-place-safe fuser outputs (issue 10.1): TransformerLayer fwd+bwd with the current
outputs vs the old view aliases (patched back in), alternating order, one process.

    python examples/bench_fuser_inplace.py
"""
import statistics, time, torch
import tp_fuse.ops.fuser as fz
from tp_fuse.layers import TransformerLayer
torch.set_num_threads(1)
layer = TransformerLayer(256, 1024, 4)
x = torch.randn(512, 2, 256, requires_grad=True)
new = fz._outputs_safe_for_inplace
def old(outputs, inputs):
    seen = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    out = []
    for t in outputs:
        if id(t) in seen: t = t.view_as(t)
        seen.add(id(t)); out.append(t)
    return out
def step():
    y = layer(x); y = y[0] if isinstance(y, tuple) else y
    y.sum().backward()
fns = {"new": new, "old": old}
times = {k: [] for k in fns}
for rep in range(40):
    order = list(fns) if rep % 2 else list(fns)[::-1]
    for name in order:
        fz._outputs_safe_for_inplace = fns[name]
        step()
        t0 = time.perf_counter(); step(); times[name].append(time.perf_counter() - t0)
n, o = statistics.median(times["new"][4:]), statistics.median(times["old"][4:])
print(f"TransformerLayer(256, 1024, 4), x [512, 2, 256] fp32, fwd+bwd median of 36: in-place-safe outputs {n*1e3:.1f} ms, "
      f"old view aliases {o*1e3:.1f} ms, ratio {n/o:.3f}")
