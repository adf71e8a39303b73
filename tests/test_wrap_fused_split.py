"""``wrap()`` with fused column projections of UNEQUAL split sizes (issue 10, point 5).

* transformers ``Phi3ForCausalLM`` (GQA: 4 heads, 2 KV heads; fused ``qkv_proj`` =
  ``[q: 32; k: 16; v: 16]``, fused ``gate_up_proj``) wrapped with its built-in plan at
  TP=2 against the unwrapped model, in float64: logits, loss, every gradient, three AdamW
  steps; ``full_state_dict`` equals the original ``state_dict`` exactly; per-rank
  ``[q_r; k_r; v_r]`` checked against slices of the full weight taken by hand;
* a hand-built GQA block whose fused ``qkv`` (with bias) is wrapped as a plain
  ``"column"`` (the old way: wrong numbers; now refused by the first forward's trace,
  naming the ``FusedColumn`` to write) and as ``FusedColumn`` with sizes and with head
  counts (right);
* the ValueErrors: sizes that do not sum to ``out_features``, a part not divisible by
  the TP size, KV heads not dividing the TP size (hand plan and Phi-3 family plan).

One process start (2 gloo ranks) runs every case; the tests read the results.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import case_values, run_cases, run_distributed
from tp_fuse.layers import FusedColumn, ShardSpec, shard_tensor
from tolerances import tols

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
_CASES: dict[str, Callable[[int, int], Any]] = {}
V, S, B = 64, 8, 2
F64 = torch.float64


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| - (atol + rtol |b|) with the float64 table: <= 0 means close."""
    t = tols(F64)
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() - (t["atol"] + t["rtol"] * b.abs())).max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _fused_ops(model: nn.Module) -> list[str]:
    return sorted({type(op).__name__ for m in model.modules() if hasattr(m, "fusers")
                   for f in m.fusers() for op, _ in (*f.forward_ops, *f.backward_ops)})


# ---- Phi-3 (transformers) ----------------------------------------------------------------


def _phi3(**over: Any) -> nn.Module:
    import transformers as tf

    cfg = tf.Phi3Config(**{"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": S,
                           "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, **over})
    torch.manual_seed(5)
    model = tf.Phi3ForCausalLM(cfg).to(F64)
    with torch.no_grad():  # non-trivial norms (all-ones inits hide layout bugs)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n)), dtype=F64))
    return model


@case
def phi3_family_plan(rank: int, world: int) -> dict[str, Any]:
    from tp_fuse.layers import full_grads, full_state_dict, wrap

    group = dist.new_group(list(range(world)))
    ref = _phi3()
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    model = wrap(copy.deepcopy(ref), group, verbose=False)
    out: dict[str, Any] = {"report": str(model.tp_fuse_wrap_report)}
    sd = model.state_dict()
    out["keys_same"] = sorted(sd) == sorted(ref_sd)
    out["qkv_shape"] = tuple(sd["model.layers.0.self_attn.qkv_proj.weight"].shape)
    out["gate_up_shape"] = tuple(sd["model.layers.0.mlp.gate_up_proj.weight"].shape)
    # This rank's rows, taken by hand from the full weight: [q_r; k_r; v_r] and [gate_r; up_r].
    w = ref_sd["model.layers.1.self_attn.qkv_proj.weight"]
    q, k, v = w[:32], w[32:48], w[48:]
    want = torch.cat([q[16 * rank:16 * rank + 16], k[8 * rank:8 * rank + 8], v[8 * rank:8 * rank + 8]])
    out["qkv_rows_by_hand"] = torch.equal(sd["model.layers.1.self_attn.qkv_proj.weight"], want)
    gu = ref_sd["model.layers.1.mlp.gate_up_proj.weight"]
    want = torch.cat([gu[:48][24 * rank:24 * rank + 24], gu[48:][24 * rank:24 * rank + 24]])
    out["gate_up_rows_by_hand"] = torch.equal(sd["model.layers.1.mlp.gate_up_proj.weight"], want)
    full = full_state_dict(model, group)
    out["full_state_dict_exact"] = sorted(full) == sorted(ref_sd) and all(
        torch.equal(full[n], ref_sd[n]) for n in ref_sd)
    attn = model.model.layers[0].self_attn
    out["local_heads"] = (attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.num_key_value_heads)
    out["model_config_heads"] = (model.config.num_attention_heads, model.config.num_key_value_heads)
    out["attn_impl_shared"] = attn.config._attn_implementation == model.config._attn_implementation

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out["loss_err"], out["logits_err"], out["grad_err"] = [], [], []
    for step in range(3):
        ids = _tokens(step)
        res, res_ref = model(ids, labels=ids), ref(ids, labels=ids)
        res.loss.backward()
        res_ref.loss.backward()
        out["loss_err"].append(_max_err(res.loss, res_ref.loss))
        out["logits_err"].append(_max_err(res.logits, res_ref.logits))
        fg = full_grads(model, group)
        out["grad_err"].append(max(_max_err(fg[n], p.grad) for n, p in ref.named_parameters()))
        if step == 0:
            out["grad_names_same"] = sorted(n for n, g in fg.items() if g is not None) == sorted(
                n for n, p in ref.named_parameters() if p.grad is not None)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    full = full_state_dict(model, group)
    out["params_after_err"] = max(_max_err(full[n], p) for n, p in ref.named_parameters())
    # Strict round trip of the per-rank state_dict into a freshly wrapped model.
    fresh = wrap(_phi3(), group, verbose=False)
    fresh.load_state_dict(model.state_dict(), strict=True)
    mine = dict(model.named_parameters())
    out["round_trip_equal"] = all(torch.equal(p, mine[n]) for n, p in fresh.named_parameters())
    out["fused_ops"] = _fused_ops(model)
    return out


@case
def phi3_kv_heads_refused(rank: int, world: int) -> dict[str, str]:
    from tp_fuse.layers import wrap

    group = dist.new_group(list(range(world)))
    try:
        wrap(_phi3(num_key_value_heads=1), group, verbose=False)
        return {"error": "no error"}
    except ValueError as e:
        return {"error": str(e)}


@case
def fused_attention_excluded(rank: int, world: int) -> dict[str, Any]:
    """An excluded attention keeps its full fused projection, so the family fix-ups (GPT-2's
    ``split_size``, Phi-3's local heads) must leave it alone."""
    import transformers as tf
    from tp_fuse.layers import wrap

    group = dist.new_group(list(range(world)))
    torch.manual_seed(4)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=S,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to(F64)
    out = {}
    for label, ref, excluded in (("gpt2", gpt2, "transformer.h.1.attn"), ("phi3", _phi3(), "model.layers.1.self_attn")):
        model = wrap(copy.deepcopy(ref), group, exclude=[excluded], verbose=False)
        ids = _tokens(9)
        try:
            out[label] = _max_err(model(ids).logits, ref(ids).logits)
        except Exception as e:  # noqa: BLE001 - the old fix-up made the excluded attention fail
            out[label] = f"{type(e).__name__}: {e}"
    return out


@case
def half_attention_excluded(rank: int, world: int) -> dict[str, str]:
    """Excluding one projection of a column/row pair (``qkv_proj`` but not ``o_proj``) would
    feed sharded heads into an unsharded projection: refused, naming the way out."""
    from tp_fuse.layers import wrap

    group = dist.new_group(list(range(world)))
    try:
        wrap(_phi3(), group, exclude=["model.layers.1.self_attn.qkv_proj"], verbose=False)
        return {"error": "no error"}
    except ValueError as e:
        return {"error": str(e)}


# ---- a hand-built GQA block with a fused qkv (bias included) ------------------------------


class GQABlock(nn.Module):
    """Attention with ``qkv = [q: H*d; k: KV*d; v: KV*d]`` (with bias). The split reads the
    per-rank width of the projection's output: ``q`` is ``H / (H + 2 KV)`` of it."""

    def __init__(self, h: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, h // heads
        self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(heads * self.head_dim, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [b, s, h]
        b, s, _ = x.shape
        qkv = self.qkv(x)  # [b, s, (H + 2 KV) d / tp]
        unit = qkv.shape[-1] // (self.heads + 2 * self.kv_heads)
        q, k, v = qkv.split([self.heads * unit, self.kv_heads * unit, self.kv_heads * unit], dim=-1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, local heads, s, d]
        return x + self.proj(y.transpose(1, 2).reshape(b, s, -1))


def _gqa_block() -> nn.Module:
    torch.manual_seed(11)
    block = GQABlock().to(F64)
    with torch.no_grad():
        block.qkv.bias.normal_(0.0, 0.5)  # a bias laid out like the weight's rows
    return block


@case
def unequal_fused_block(rank: int, world: int) -> dict[str, Any]:
    from tp_fuse.layers import full_grads, full_state_dict, wrap

    group = dist.new_group(list(range(world)))
    ref = _gqa_block()
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(2), dtype=F64)
    y_ref = ref(x)
    y_ref.square().sum().backward()
    styles = {
        "plain_column": "column",
        "sizes": FusedColumn((32, 16, 16), names=("q", "k", "v")),
        "heads": FusedColumn((4, 2, 2), head_dim=8, names=("q", "k", "v")),
    }
    out: dict[str, Any] = {}
    for label, style in styles.items():
        model = wrap(copy.deepcopy(ref), group, plan={"qkv": style, "proj": "row"}, verbose=False)
        model.zero_grad()
        if label == "plain_column":  # no probe: the trace of the first forward refuses it (issue 39)
            try:
                model(x)
                out[label] = "no error"
            except ValueError as e:
                out[label] = str(e)
            continue
        y = model(x)
        y.square().sum().backward()
        fg, full = full_grads(model, group), full_state_dict(model, group)
        ref_sd = ref.state_dict()
        out[label] = {
            "y_err": _max_err(y, y_ref),
            "y_rel": _rel(y.detach(), y_ref.detach()),
            "grad_err": max(_max_err(fg[n], p.grad) for n, p in ref.named_parameters()),
            "full_state_dict_exact": all(torch.equal(full[n], ref_sd[n]) for n in ref_sd),
            "report": dict(model.tp_fuse_wrap_report.converted)["qkv"],
        }
    return out


@case
def unequal_fused_errors(rank: int, world: int) -> dict[str, str]:
    from tp_fuse.layers import wrap

    group = dist.new_group(list(range(world)))
    plans = {
        "sum": FusedColumn((32, 16, 8), names=("q", "k", "v")),
        "part_not_divisible": FusedColumn((33, 15, 16), names=("q", "k", "v")),
        "kv_heads": FusedColumn((6, 1, 1), head_dim=8, names=("q", "k", "v")),
        "head_sum": FusedColumn((4, 2, 1), head_dim=8),
    }
    out = {}
    for label, style in plans.items():
        try:
            wrap(_gqa_block() if label != "kv_heads" else GQABlock(48, 6, 1).to(F64), group,
                 plan={"qkv": style, "proj": "row"}, verbose=False)
            out[label] = "no error"
        except ValueError as e:
            out[label] = str(e)
    return out


def _needs_transformers(name: str) -> Optional[str]:
    if name.startswith(("phi3", "fused_attention")) and not HAVE_TRANSFORMERS:
        return "transformers is not installed"
    return None


def _run_all_cases(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    return run_cases(_CASES, rank, world, _needs_transformers)


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(2, _run_all_cases, timeout=300)


# ---- tests -----------------------------------------------------------------------------


@pytest.mark.multirank
def test_phi3_tp2_matches_unwrapped_float64(results) -> None:
    for v in case_values(results, "phi3_family_plan"):
        assert "plan for model_type 'phi3'" in v["report"], v["report"]
        assert "fused_column(q=32, k=16, v=16)" in v["report"], v["report"]
        assert "fused_column(parts=2)" in v["report"], v["report"]
        assert v["keys_same"] and v["grad_names_same"]
        assert v["qkv_shape"] == (32, 32) and v["gate_up_shape"] == (48, 32), (v["qkv_shape"], v["gate_up_shape"])
        assert v["qkv_rows_by_hand"] and v["gate_up_rows_by_hand"]
        assert v["full_state_dict_exact"], "full_state_dict must give back the original layout exactly"
        # This rank's attention sees 2 of 4 heads and 1 of 2 KV heads; the model's config is untouched.
        assert v["local_heads"] == (2, 1, 1) and v["model_config_heads"] == (4, 2), v
        assert v["attn_impl_shared"]
        for key in ("loss_err", "logits_err", "grad_err"):
            assert max(v[key]) <= 0, (key, v[key])
        assert v["params_after_err"] <= 0, v["params_after_err"]
        assert v["round_trip_equal"]
        # o_proj / down_proj (row-parallel, no SP): GEMM + all-reduce fused.
        assert "UserbuffersForwardLinearAllReduce" in v["fused_ops"], v["fused_ops"]


@pytest.mark.multirank
def test_phi3_kv_heads_not_dividing_tp_refused(results) -> None:
    for v in case_values(results, "phi3_kv_heads_refused"):
        assert "config.num_key_value_heads (1) is not divisible by the TP size (2)" in v["error"], v["error"]


@pytest.mark.multirank
def test_excluded_fused_attention_left_alone(results) -> None:
    for v in case_values(results, "fused_attention_excluded"):
        for label in ("gpt2", "phi3"):
            assert isinstance(v[label], float) and v[label] <= 0, (label, v[label])


@pytest.mark.multirank
def test_excluding_half_of_a_tp_pair_refused(results) -> None:
    for v in case_values(results, "half_attention_excluded"):
        assert ("model.layers.1.self_attn.qkv_proj is excluded but its sibling(s) "
                "['model.layers.1.self_attn.o_proj'] are sharded") in v["error"], v["error"]
        assert "exclude model.layers.1.self_attn instead" in v["error"], v["error"]


@pytest.mark.multirank
def test_unequal_fused_projection_split_per_part(results) -> None:
    for v in case_values(results, "unequal_fused_block"):
        # The old way, a plain column, gave rank 0 all of q: wrong numbers, no error. The
        # first forward's trace sees the model split the output, and names the entry to write
        # (sizes scaled from the per-rank widths it saw).
        plain = v["plain_column"]
        assert plain.startswith("wrap: the first forward of the wrapped model shows it cannot be correct"), plain
        assert "qkv: plan['qkv'] = 'column', but the model's forward (split in <root>)" in plain, plain
        assert "Write plan['qkv'] = FusedColumn((32, 16, 16))" in plain, plain
        for label in ("sizes", "heads"):
            r = v[label]
            assert r["y_err"] <= 0 and r["grad_err"] <= 0, (label, r)
            assert r["full_state_dict_exact"], label
        assert v["sizes"]["report"] == "Linear -> fused_column(q=32, k=16, v=16)-parallel", v["sizes"]["report"]
        assert v["heads"]["report"] == "Linear -> fused_column(heads q=4, k=2, v=2 x 8)-parallel"


@pytest.mark.multirank
def test_unequal_fused_projection_errors(results) -> None:
    for v in case_values(results, "unequal_fused_errors"):
        assert "qkv: fused_column(q=32, k=16, v=8): split sizes [32, 16, 8] sum to 56, but the weight's " \
               "out_features is 64" in v["sum"], v["sum"]
        assert "part 'q' has 33 output features, not divisible by the TP size (2)" in v["part_not_divisible"]
        assert "part 'k' has 15 output features" in v["part_not_divisible"], v["part_not_divisible"]
        assert "part 'k' has 1 heads (8 features), not divisible by the TP size (2)" in v["kv_heads"], v["kv_heads"]
        assert "part 'v' has 1 heads" in v["kv_heads"], v["kv_heads"]
        assert "head counts [4, 2, 1] x head_dim 8 give 32+16+8 = 56 features, but the weight's out_features is 64" \
            in v["head_sum"], v["head_sum"]


# ---- single process: the style and the layout ------------------------------------------


@pytest.mark.parametrize("bad, match", [
    (dict(parts=1), "parts must be an int >= 2"),
    (dict(parts=(32,)), "tuple of >= 2 positive ints"),
    (dict(parts=(32, 0, 16)), "tuple of >= 2 positive ints"),
    (dict(parts=(32, 16.0, 16)), "tuple of >= 2 positive ints"),
    (dict(parts="qkv"), "tuple of >= 2 positive ints"),
    (dict(parts=(4, 2, 2), names=("q", "k")), "names must be 3 non-empty strings"),
    (dict(parts=3, head_dim=8), "head_dim needs parts as per-part head counts"),
    (dict(parts=(4, 2, 2), head_dim=0), "head_dim must be a positive int"),
])
def test_fused_column_arguments_checked(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FusedColumn(**bad)


def test_fused_column_layouts() -> None:
    assert FusedColumn(3).spec(96) == ShardSpec(dim=0, blocks=3)
    assert FusedColumn((32, 32)).spec(64) == ShardSpec(dim=0, blocks=2)  # equal sizes: plain blocks
    spec = FusedColumn((4, 2, 2), head_dim=8).spec(64)
    assert spec == ShardSpec(dim=0, sizes=(32, 16, 16)) and spec.blocks == 3


def test_shard_tensor_unequal_parts_slice_each_part() -> None:
    full = torch.arange(12 * 2).reshape(12, 2)
    q, k, v = full[:6], full[6:9], full[9:]
    spec = ShardSpec(dim=0, sizes=(6, 3, 3))
    for rank in range(3):
        want = torch.cat([q[2 * rank:2 * rank + 2], k[rank:rank + 1], v[rank:rank + 1]])
        assert torch.equal(shard_tensor(full, spec, rank, 3), want)
    with pytest.raises(ValueError, match=r"every part must be divisible by 2"):
        shard_tensor(full, spec, 0, 2)
    with pytest.raises(ValueError, match=r"into parts \[6, 3, 3\]: they sum to 12"):
        shard_tensor(full[:10], spec, 0, 3)
    with pytest.raises(ValueError, match="sizes must be a tuple of >= 2 positive ints"):
        ShardSpec(dim=0, sizes=(4,))
