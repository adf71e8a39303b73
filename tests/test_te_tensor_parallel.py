"""BasicLinear/Linear(tensor_parallel_mode=..., sequence_parallel=...) on 2 gloo ranks:
the op expands to our comm ops, matches the unsharded float64 linear, and the
userbuffers overlap fusions apply to the expansion. Row parallel: each rank's own bias is
added before the reduction (Transformer Engine; tests/test_te_row_parallel_bias.py has the
FP8 and unfused cases)."""

import pytest
import torch
import torch.distributed as dist

import tp_fuse as te
from tp_fuse import ops
from dist_utils import run_distributed

SEQ, IN, OUT = 8, 12, 16


def _cases(rank: int, world: int) -> dict:
    out = {}
    group = dist.group.WORLD
    for mode in ("column", "row"):
        for sp in (False, True):
            torch.manual_seed(0)  # same full tensors on every rank
            w = torch.randn(OUT, IN, dtype=torch.float64)
            b = torch.randn(OUT, dtype=torch.float64)
            b_parts = torch.randn(world, OUT, dtype=torch.float64)  # row parallel: per rank
            x = torch.randn(SEQ, IN, dtype=torch.float64)
            dy = torch.randn(SEQ, OUT, dtype=torch.float64)
            lin = ops.Linear(IN, OUT, dtype=torch.float64, tensor_parallel_mode=mode,
                             tensor_parallel_group=group, sequence_parallel=sp)
            rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
            with torch.no_grad():
                if mode == "column":
                    cols = slice(rank * OUT // world, (rank + 1) * OUT // world)
                    lin.weight.copy_(w[cols])
                    lin.bias.copy_(b[cols])
                    x_in = x[rows] if sp else x
                    dy_in = dy[:, cols]
                else:
                    ks = slice(rank * IN // world, (rank + 1) * IN // world)
                    lin.weight.copy_(w[:, ks])
                    lin.bias.copy_(b_parts[rank])
                    x_in = x[:, ks]
                    dy_in = dy[rows] if sp else dy
            seq = ops.Sequential(lin)
            xt = x_in.clone().requires_grad_()
            y = seq(xt)
            y.backward(dy_in)
            xr = x.clone().requires_grad_()
            wr = w.clone().requires_grad_()
            br = (b if mode == "column" else b_parts).clone().requires_grad_()
            yr = xr @ wr.t() + (br if mode == "column" else br.sum(0))
            yr.backward(dy)
            if mode == "column":
                torch.testing.assert_close(y, yr.detach()[:, cols])
                torch.testing.assert_close(xt.grad, xr.grad[rows] if sp else xr.grad)
                torch.testing.assert_close(lin.weight.grad, wr.grad[cols])
                torch.testing.assert_close(lin.bias.grad, br.grad[cols])
            else:
                torch.testing.assert_close(y, yr.detach()[rows] if sp else yr.detach())
                torch.testing.assert_close(xt.grad, xr.grad[:, ks])
                torch.testing.assert_close(lin.weight.grad, wr.grad[:, ks])
                # Every rank's bias gradient covers the whole sequence (also under SP).
                assert not getattr(lin.bias, "sequence_parallel", False)
                torch.testing.assert_close(lin.bias.grad, br.grad[rank])
            exp = str(seq.explain())
            out[(mode, sp)] = (
                [type(o).__name__ for o in lin.basic_op_list],
                [type(op).__name__ for op, _ in seq.fusers()[0].forward_ops],
                exp,
            )
    return out


@pytest.mark.multirank
def test_tensor_parallel_linear_matches_unsharded():
    results = run_distributed(2, _cases, timeout=240)
    r = results[0]
    assert r[("column", True)][0] == ["AllGather", "BasicLinear", "Bias"]
    assert r[("column", False)][0] == ["BasicLinear", "Bias"]
    assert r[("row", True)][0] == ["BasicLinear", "Bias", "ReduceScatter"]
    assert r[("row", False)][0] == ["BasicLinear", "Bias", "AllReduce"]
    # The overlap fusions apply to the expansion (the requirement).
    assert r[("column", True)][1][0] == "UserbuffersForwardLinear"
    assert r[("row", True)][1][0] == "UserbuffersForwardLinear"
    assert r[("row", False)][1][0] == "UserbuffersForwardLinearAllReduce"


def test_tensor_parallel_argument_errors():
    import pytest

    with pytest.raises(ValueError, match="tensor_parallel_mode must be None, 'column' or 'row'"):
        ops.BasicLinear(4, 4, tensor_parallel_mode="col")
    with pytest.raises(ValueError, match="sequence_parallel need tensor_parallel_mode"):
        ops.BasicLinear(4, 4, sequence_parallel=True)
    # TP size 1 (no process group): the op is a plain linear.
    lin = ops.BasicLinear(4, 6, tensor_parallel_mode="column")
    assert lin.weight.shape == (6, 4) and lin.expanded_ops() == [lin]
