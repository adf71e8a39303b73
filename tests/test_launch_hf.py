"""``+model=hf model.path=<dir>`` end to end (2 ranks, TP=2, FP8, overlap), and the
model directory's handling: sizes from config.json, tokenizer.json, safetensors weights
loaded, pickled weights refused, errors naming the file. Directories are written here
(tiny Llama config, a BPE tokenizer trained on a few kB); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import shutil
import traceback
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e .[hf])")

from tp_fuse.launch.api import compose, train  # noqa: E402
from tp_fuse.launch.config import CONFIG_DIR  # noqa: E402
from tp_fuse.launch.config_validate import validate  # noqa: E402
from tp_fuse.launch.config_errors import precheck  # noqa: E402
from tp_fuse.launch.checkpoint.hf_export import export_hf_directory  # noqa: E402
from tp_fuse.launch.models import hf_config as hf_module  # noqa: E402
from tp_fuse.launch.data import stdlib_corpus  # noqa: E402
from tp_fuse.launch.models.hf import build_hf_model, load_tokenizer  # noqa: E402
from tp_fuse.launch.logging.metrics import read_jsonl  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

VOCAB = 320


def _edit_config(model_dir: str, **fields) -> None:
    """Rewrite config.json with ``fields`` set (None: removed)."""
    file = os.path.join(model_dir, "config.json")
    with open(file) as f:
        data = json.load(f)
    data.update(fields)
    with open(file, "w") as f:
        json.dump({k: v for k, v in data.items() if v is not None}, f)


def _model_dir(root, *, weights: bool, seed: int = 0, kv_heads: int = 2, family: str = "llama",
               **config: float) -> str:
    path = str(root)
    os.makedirs(path, exist_ok=True)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                             "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
                             "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
                             "glm": (transformers.GlmConfig, transformers.GlmForCausalLM)}[family]
    # Their default special token ids (32000, 50279, 151329) lie outside the tiny vocabulary.
    special = ({"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0} if family in ("phi3", "olmo2", "glm")
               else {})
    cfg = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                     **special, **config)
    if weights:
        torch.manual_seed(seed)
        model_cls(cfg).save_pretrained(path, safe_serialization=True)
    else:
        cfg.save_pretrained(path)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(_tokenizer_json())
    return path


@functools.cache
def _tokenizer_json() -> str:
    """A BPE tokenizer (vocabulary VOCAB) trained on a few kB, as tokenizer.json's text:
    trained once per module, since every model directory here holds the same one."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[UNK]"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([stdlib_corpus()[:20000]], trainer=trainer)
    return tok.to_str()


@pytest.mark.multirank
def test_hf_llama_tp2_fp8_overlap(tp2_runs):
    run_dir = _tp2_run(tp2_runs, "llama")
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    # Tokens come from the model's tokenizer (vocab 320): the first loss is about ln(320), not ln(256).
    assert abs(metrics[0]["loss"] - math.log(VOCAB)) < 0.5, metrics[0]["loss"]
    assert os.path.exists(os.path.join(run_dir, "fp8_stats.jsonl"))


@pytest.mark.multirank
def test_hf_phi3_tp2_checkpoint_resumes_at_tp1(tp2_runs, tmp_path):
    """Phi-3's fused unequal [q; k; v] (GQA) through the launcher: trained at TP=2 with its
    built-in plan, checkpointed (each part stored on its own, tp_fuse.layers.ShardSpec.sizes),
    resumed at TP=1 where the loss trajectory continues."""
    run_dir = _tp2_run(tp2_runs, "phi3")
    assert "plan for model_type 'phi3'" in tp2_runs["ranks"][0]["phi3"]["printed"]
    root = tp2_runs["root"] / "phi3"
    args = _phi3_args(str(root / "model"), tp2_runs["corpus"])
    expected = {m["step"]: m["loss"] for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    assert sorted(expected) == [1, 2, 3, 4]
    ck = tmp_path / "ck1"
    ck.mkdir()
    shutil.copytree(root / "ck" / "step_00000002", ck / "step_00000002")
    result = train([*args, "checkpoint.resume=true", f"checkpoint.dir={ck}", "parallel.tp=1"], str(tmp_path / "run1"))
    assert result.start_step == 2
    for step in (3, 4):  # TP=1 vs TP=2: float32 reduction order only
        assert result.losses[step] == pytest.approx(expected[step], rel=2e-4), (step, result.losses, expected)
    # checkpoint.export_hf (issue 22: a Hugging Face directory from a launcher checkpoint):
    # the TP=2 run exported its step-4 model (gathered) at its end; resuming its step-4
    # checkpoint at TP=1 only to export gives the same tensors, bit for bit.
    shutil.copytree(root / "ck", tmp_path / "ck")
    hf_tp1 = tmp_path / "hf_tp1"
    again = train([*args, "checkpoint.resume=true", f"checkpoint.dir={tmp_path / 'ck'}", "parallel.tp=1",
                   f"checkpoint.export_hf={hf_tp1}"], str(tmp_path / "run2"))
    assert again.start_step == 4 and again.already_complete
    tp2_sd = transformers.AutoModelForCausalLM.from_pretrained(root / "hf_tp2").state_dict()
    tp1_sd = transformers.AutoModelForCausalLM.from_pretrained(hf_tp1).state_dict()
    assert tp2_sd.keys() == tp1_sd.keys() and all(torch.equal(tp2_sd[k], tp1_sd[k]) for k in tp2_sd)
    initial = transformers.AutoModelForCausalLM.from_pretrained(root / "model").state_dict()
    assert not torch.equal(initial["model.layers.0.self_attn.qkv_proj.weight"],
                           tp2_sd["model.layers.0.self_attn.qkv_proj.weight"])  # trained, and in the fused layout


@pytest.mark.multirank
def test_hf_qwen3_tp2_matches_tp1(tp2_runs):
    """Issue 22: qwen3's q_norm/k_norm (shared by all heads, used per head) need their
    gradient summed over TP; without it TP=2 drifted from TP=1 (9.5e-4 after 12 steps) and
    exited 0. The start-up verify (model.verify, default true) is on in the TP=2 run."""
    _tp2_matches_tp1(tp2_runs, "qwen3", [
        "q_norm.weight (x2): replicated, used on TP-sharded activations",
        "verified: outputs and every gradient match the original",
    ])


@pytest.mark.multirank
def test_hf_olmo2_tp2_matches_tp1(tp2_runs):
    """OLMo2 through the launcher (issue 22): its q_norm/k_norm normalise the whole q/k
    projection (all heads), so its plan shards them with the heads ("sharded_norm": weight
    split, mean of squares summed over TP). TP=2 (start-up verify on) matches TP=1 over 12
    steps from the same safetensors weights."""
    _tp2_matches_tp1(tp2_runs, "olmo2", [
        "plan for model_type 'olmo2'",
        "sharded norm (weight split with the features, statistics summed over TP)",
        "verified: outputs and every gradient match the original",
    ])


def _tp2_matches_tp1(tp2_runs, name: str, expected_lines: list[str], steps: int = 12) -> None:
    """The TP=2 run ``name`` (start-up verify on) printed ``expected_lines`` and trained as
    TP=1 does in-process from the same weights: every step's loss at 1e-4 (float32 reduction order)."""
    _tp2_run(tp2_runs, name)
    out = tp2_runs["ranks"][0][name]["printed"]
    for line in expected_lines:
        assert line in out, (line, out[-3000:])
    tp2 = tp2_runs["ranks"][0][name]["losses"]
    root = tp2_runs["root"] / name
    tp1 = train([*_family_args(str(root / "model"), tp2_runs["corpus"], steps), "parallel.tp=1"],
                str(root / "run1")).losses
    assert sorted(tp2) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert tp2[step] == pytest.approx(tp1[step], rel=1e-4), (step, tp2, tp1)


# ---- issue 22: the other built-in families through +model=hf, TP=2 vs TP=1 ----

#: Tiny configs of the families +model=hf takes beyond the first eight: config class, model
#: class, fields. Each sets the feature that needs the family's own handling so that the
#: run exercises it: tied embeddings (gemma, gemma3_text, cohere, opt, starcoder2, bloom),
#: logit soft-capping (gemma2), parallel attention/MLP blocks (cohere, phi, gptj, stablelm),
#: Granite's multipliers, shared q/k norms (phi, gemma3_text, qwen3_moe: gradient summed
#: over TP by wrap), Gemma3's sliding-window layer (window 8 < data.seq_len 32) beside a
#: full one, Bloom's ALiBi (sliced per rank by its plan's fix-up), routed experts
#: (replicated: mixtral, qwen2_moe, qwen3_moe) and Qwen2-MoE's gated shared expert
#: (sharded). Special token ids 0: their defaults lie outside VOCAB.
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
_NEW_FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                                         query_pre_attn_scalar=8, final_logit_softcapping=2.0,
                                                         attn_logit_softcapping=3.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_key_value_heads=2,
                                                            num_local_experts=4, num_experts_per_tok=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(intermediate_size=64, num_key_value_heads=2,
                                                            embedding_multiplier=2.0, logits_scaling=1.5,
                                                            residual_multiplier=0.5, attention_multiplier=0.2)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(intermediate_size=64, num_key_value_heads=2,
                                                         logit_scale=0.5)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(intermediate_size=64, num_key_value_heads=2,
                                                               use_parallel_residual=True, use_qkv_bias=True)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(intermediate_size=64, num_key_value_heads=2)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(intermediate_size=64, qk_layernorm=True)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32, init_std=0.3)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_inner=64, rotary_dim=4)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=64, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=64, num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=64, num_key_value_heads=2, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    # No position table (ALiBi): seq_length bounds data.seq_len where config.json gives it.
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(seq_length=64)),
}
#: The FFN width a token goes through: MoE, the experts it is routed to plus any shared expert.
_FFN = {"opt": 64, "gptj": 64, "mixtral": 2 * 48, "qwen2_moe": 2 * 32 + 64, "qwen3_moe": 2 * 32, "bloom": 4 * 32}
_GATED = ("gemma", "gemma2", "gemma3_text", "mixtral", "granite", "cohere", "stablelm", "qwen2_moe", "qwen3_moe")


def _family_dir(root, family: str, seed: int, weights: bool = True) -> str:
    """A model directory of ``family`` (tiny, BPE tokenizer; random weights in safetensors, or
    ``weights=False``: config.json only, for the tests that read sizes)."""
    config_cls, model_cls, fields = _NEW_FAMILIES[family]
    sizes = dict(_SIZES)
    if family in ("gptj", "bloom"):  # GPT-2's spellings; Bloom keeps hidden_size and has no position table
        sizes = {**{k: v for k, v in sizes.items() if k not in ("hidden_size", "num_hidden_layers",
                                                                 "num_attention_heads", "max_position_embeddings")},
                 "n_layer": 2, "n_head": 4,
                 **({"hidden_size": 32} if family == "bloom" else {"n_embd": 32, "n_positions": 64})}
    # initializer_range 0.3: large enough weights that a mis-sharded block changes the loss visibly.
    cfg = getattr(transformers, config_cls)(**sizes, **{"initializer_range": 0.3, **fields})
    path = _model_dir(root, weights=False)  # the tokenizer (and a llama config.json, replaced here)
    if not weights:
        cfg.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _counted_weights(model: torch.nn.Module) -> int:
    """What :func:`hf_module.parameter_count` counts: every parameter but norms, biases and
    MoE routers (the shared expert's sigmoid gate included)."""
    skip = ("norm", "ln_", ".bias", "mlp.gate.weight", "shared_expert_gate")
    return sum(p.numel() for n, p in model.named_parameters() if not any(k in n for k in skip))


def test_new_families_sizes_read_as_transformers_reads_them(tmp_path):
    """Each family's config.json spellings (GPT-J's n_embd, OPT's ffn_dim, Bloom's n_head and
    no position table, the MoE families' experts) give the launcher the sizes transformers
    builds the model with, class defaults included (save_pretrained leaves out values equal
    to them: Gemma's tie_word_embeddings=True), and the memory check's parameter count is
    the model's own (norms, biases and routers aside; every routed expert counted)."""
    for family in _NEW_FAMILIES:
        path = _family_dir(tmp_path / family, family, seed=0, weights=False)
        cfg = transformers.AutoConfig.from_pretrained(path)
        f = hf_module.gpt_fields(path)
        assert (f["hidden_size"], f["num_heads"], f["num_layers"], f["vocab_size"], f["max_seq_len"]) == \
            (32, 4, 2, VOCAB, 64), (family, f)
        assert f["num_query_groups"] == getattr(cfg, "num_key_value_heads", None), (family, f)
        assert f["tie_embeddings"] == cfg.tie_word_embeddings, (family, f)
        assert f["ffn_hidden_size"] == _FFN.get(family, 64), (family, f)
        assert f["activation"] == ("swiglu" if family in _GATED else "gelu"), (family, f)
        assert f["position_embedding"] == {"opt": "learned", "bloom": "alibi"}.get(family, "rope"), (family, f)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        moe = {"mixtral": (4, 2), "qwen2_moe": (4, 2, 64), "qwen3_moe": (4, 2)}.get(family, ())
        offset = 2 * 32 if family == "opt" else 0  # OPT's position table has 2 rows beyond max_position_embeddings
        assert hf_module.parameter_count(f, hf_module.attention_head_dim(path), *moe) + offset == \
            _counted_weights(model), family
    assert hf_module.moe_note(str(tmp_path / "mixtral")).startswith("MoE (mixtral): 4 routed experts per layer, 2 per")
    assert hf_module.moe_note(str(tmp_path / "qwen2_moe")).startswith(
        "MoE (qwen2_moe): 4 routed experts per layer, 2 per token, and a shared expert (width 64); FLOP/token counts "
        "the 2 a token goes through and the shared expert (ffn = 2 x 32 + 64)")
    assert hf_module.moe_note(str(tmp_path / "gemma")) is None
    # Mixtral's memory check counts all 4 experts, not the 2 a token uses.
    f = hf_module.gpt_fields(str(tmp_path / "mixtral"))
    assert hf_module.parameter_count(f, 8, 4, 2) - hf_module.parameter_count(f, 8) == 2 * 2 * 48 * 32 * 3

    # Published Qwen3-MoE files say num_experts (the class stores num_local_experts, default
    # 128); old Bloom files say n_embed; a Bloom file without seq_length: BLOOM's 2048.
    qwen3_moe, bloom = str(tmp_path / "qwen3_moe"), str(tmp_path / "bloom")
    _edit_config(qwen3_moe, num_local_experts=None, num_experts=6)
    _edit_config(bloom, hidden_size=None, n_embed=48, seq_length=None)
    assert transformers.AutoConfig.from_pretrained(qwen3_moe).num_local_experts == 6
    assert transformers.AutoConfig.from_pretrained(bloom).hidden_size == 48
    assert hf_module.moe_note(qwen3_moe).startswith("MoE (qwen3_moe): 6 routed experts per layer")
    f = hf_module.gpt_fields(bloom)
    assert (f["hidden_size"], f["ffn_hidden_size"], f["max_seq_len"]) == (48, 4 * 48, 2048), f
    # Dense layers among MoE ones cannot be described by one FFN shape: refused, saying why.
    qwen2_moe = str(tmp_path / "qwen2_moe")
    _edit_config(qwen2_moe, mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"layers \[1\] are dense MLP layers, not MoE .*through the API"):
        compose(["+model=hf", f"model.path={qwen2_moe}"])
    _edit_config(qwen2_moe, mlp_only_layers=[], decoder_sparse_step=2)
    with pytest.raises(ValueError, match=r"layers \[0\] are dense MLP layers"):
        hf_module.gpt_fields(qwen2_moe)


def test_flops_per_token_uses_config_head_dim(tmp_path):
    """The MFU line's FLOP/token takes the attention width the model has: Qwen3's head_dim
    (class default 128 here, where hidden / heads is 8) and Gemma's explicit one; it used
    hidden / heads for every model. A family whose attention ignores head_dim keeps hidden /
    heads (GPT-J: a stray head_dim in config.json changes nothing)."""
    from tp_fuse.launch.logging.report import flops_per_token
    from tp_fuse.launch.startup import model_flops_per_token

    def expected(cfg, d: int) -> float:
        g, s = cfg.model.gpt, cfg.seq_len
        attention = g.hidden_size * (g.num_heads + 2 * g.kv_groups) * d + g.num_heads * d * g.hidden_size
        mlp = g.hidden_size * g.ffn_size * (3 if g.activation == "swiglu" else 2)
        return 6.0 * (g.num_layers * (attention + mlp) + g.vocab_size * g.hidden_size) + 12.0 * g.num_layers * \
            g.num_heads * d * s

    qwen3 = _model_dir(tmp_path / "qwen3", weights=False, family="qwen3")
    assert transformers.AutoConfig.from_pretrained(qwen3).head_dim == 128
    cfg = compose(["+model=hf", f"model.path={qwen3}", "data.seq_len=32"])
    assert model_flops_per_token(cfg) == expected(cfg, 128)
    assert model_flops_per_token(cfg) > flops_per_token(cfg.model.gpt, 32)  # hidden / heads = 8: too few
    gptj = _family_dir(tmp_path / "gptj", "gptj", seed=0, weights=False)
    _edit_config(gptj, head_dim=64)
    cfg = compose(["+model=hf", f"model.path={gptj}", "data.seq_len=32"])
    assert model_flops_per_token(cfg) == expected(cfg, 8) == flops_per_token(cfg.model.gpt, 32)
    cfg = compose(["+model=gpt"])  # tp-fuse's own models: unchanged
    assert model_flops_per_token(cfg) == flops_per_token(cfg.model.gpt, cfg.seq_len)


def _family_args(model_dir: str, corpus: str, steps: int = 3) -> list[str]:
    """A run of ``steps`` steps on ``corpus`` (:func:`_corpus`), tokenized by the model's tokenizer.json."""
    return ["+model=hf", f"model.path={model_dir}", "data=text", f"data.paths=[{corpus}]", "data.seq_len=32", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4", f"trainer.max_steps={steps}", "trainer.log_interval=1",
            "trainer.val_interval=0", "logger=none", "trainer.progress=false", "optim.warmup_steps=1", "optim.lr=3e-3"]


def _phi3_args(model_dir: str, corpus: str) -> list[str]:
    return [*_family_args(model_dir, corpus, 4), "checkpoint.interval=2"]


def _corpus(root) -> str:
    """The training text of every run here: the 20 kB of the stdlib corpus the tokenizer was
    trained on (13k tokens; the longest run reads 12 x 128). Each run tokenizes its corpus
    (twice at TP=2, once per rank): the whole stdlib corpus (465 kB) cost 0.27 CPU-s a run,
    ~15 CPU-s over this module's 54 tokenizations; which text it is does not matter here."""
    path = os.path.join(str(root), "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(stdlib_corpus()[:20000])
    return path


def _tp2_all(rank: int, world_size: int, root: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Every TP=2 run of this module in ONE 2-rank start (a torchrun start per run cost
    ~15-20 CPU-s each; torchrun's own start of +model=hf at TP=2 is in
    test_export_hf_atomic.py): ``tp_fuse.launch.api.train`` runs the launcher's whole path
    -- config check, wrap with the family's plan, start-up verify, checkpoints, export --
    inside these ranks."""
    os.environ.update({"WORLD_SIZE": str(world_size), "RANK": str(rank)})
    out: dict[str, Any] = {}
    for name, args in runs.items():
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                losses = train([*args, "parallel.tp=2"], os.path.join(root, name, "run")).losses
            out[name] = {"losses": losses, "printed": printed.getvalue()}
        except Exception:  # noqa: BLE001 - reported to the parent, with what it printed
            out[name] = {"error": traceback.format_exc(), "printed": printed.getvalue()}
    return out


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory) -> dict[str, Any]:
    """The TP=2 runs: Llama with FP8 and overlap (4 steps); Phi-3 with checkpoints every 2
    steps and an export; Qwen3 and OLMo2 (12 steps); every family of _NEW_FAMILIES (3 steps)."""
    root = tmp_path_factory.mktemp("hf_tp2")
    corpus = _corpus(root)
    runs = {}
    model = _model_dir(root / "llama" / "model", weights=False)
    runs["llama"] = [*_family_args(model, corpus, 4), "fp8=delayed", "overlap=on"]
    # initializer_range 0.3: large enough weights that a mis-assembled qkv changes the loss visibly.
    model = _model_dir(root / "phi3" / "model", weights=True, seed=3, family="phi3", initializer_range=0.3)
    runs["phi3"] = [*_phi3_args(model, corpus), f"checkpoint.dir={root / 'phi3' / 'ck'}",
                    f"checkpoint.export_hf={root / 'phi3' / 'hf_tp2'}"]
    for family, seed in (("qwen3", 4), ("olmo2", 5)):
        model = _model_dir(root / family / "model", weights=True, seed=seed, family=family, initializer_range=0.3)
        runs[family] = _family_args(model, corpus, 12)
    for family in sorted(_NEW_FAMILIES):
        runs[family] = _family_args(_family_dir(root / family / "model", family, seed=6), corpus)
    return {"root": root, "corpus": corpus, "ranks": run_distributed(2, _tp2_all, str(root), runs, timeout=900)}


def _tp2_run(tp2_runs, name: str) -> str:
    """The run directory of the TP=2 run ``name``, after checking that no rank failed."""
    for rank, r in enumerate(tp2_runs["ranks"]):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}\n{r[name]['printed'][-3000:]}"
    return str(tp2_runs["root"] / name / "run")


@pytest.mark.multirank
@pytest.mark.parametrize("family", sorted(_NEW_FAMILIES))
def test_hf_family_tp2_matches_tp1(tp2_runs, family):
    """Each family +model=hf accepts beyond the first eight: TP=2 (its built-in plan, start-up
    verify on) trains as TP=1 does from the same safetensors weights, 3 steps at 1e-4."""
    ranks = [r[family] for r in tp2_runs["ranks"]]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}:\n{r['error']}\n{r['printed'][-3000:]}"
    out = ranks[0]["printed"]
    assert f"plan for model_type '{family}'" in out, out[-3000:]
    assert "verified: outputs and every gradient match the original" in out, out[-3000:]
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        assert f"MoE ({family}): 4 routed experts per layer, 2 per token" in out, out[-3000:]
        assert "routed MoE experts: replicated on every TP rank" in out, out[-3000:]
    tp2 = ranks[0]["losses"]
    assert ranks[1]["losses"] == tp2  # every rank reports the same (all-reduced) losses
    root = tp2_runs["root"]
    tp1 = train([*_family_args(str(root / family / "model"), tp2_runs["corpus"]), "parallel.tp=1"],
                str(root / family / "run1")).losses
    assert sorted(tp2) == [1, 2, 3]
    for step in (1, 2, 3):  # float32 reduction order only
        assert tp2[step] == pytest.approx(tp1[step], rel=1e-4), (step, tp2, tp1)


def test_sizes_come_from_config_json_and_are_validated(tmp_path):
    model_dir = _model_dir(tmp_path, weights=False)
    cfg = compose(["+model=hf", f"model.path={model_dir}"])
    assert (cfg.model.gpt.hidden_size, cfg.model.gpt.num_heads, cfg.model.gpt.num_query_groups) == (32, 4, 2)
    assert cfg.model.gpt.vocab_size == VOCAB and cfg.model.gpt.max_seq_len == 64
    with pytest.raises(ValueError, match=r"parallel.tp \(4\) must divide model.num_query_groups \(2\)"):
        validate(cfg, world_size=4)
    with pytest.raises(ValueError, match="does not apply to \\+model=hf"):
        validate(compose(["+model=hf", f"model.path={model_dir}", "parallel.sequence_parallel=true"]), 2)
    with pytest.raises(ValueError, match="needs model.path"):
        compose(["+model=hf"])
    # ALiBi (Bloom's config.json) describes a model transformers builds; tp-fuse's own has none.
    with pytest.raises(ValueError, match=r"got 'alibi' \(ALiBi is read from a Hugging Face Bloom config.json by "):
        validate(compose(["+model=gpt", "model.position_embedding=alibi"]), world_size=1)
    with pytest.raises(ValueError, match="model.hidden_size: \\+model=hf takes model.path"):
        compose(["+model=hf", f"model.path={model_dir}", "+model.hidden_size=64"])
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"model_type": "bert"}, f)
    with pytest.raises(ValueError, match="model_type 'bert' is not one the launcher reads the sizes of"):
        compose(["+model=hf", f"model.path={model_dir}"])


def test_weights_loaded_from_safetensors_pickle_refused_tokenizer(tmp_path):
    model_dir = _model_dir(tmp_path / "w", weights=True, seed=5)
    torch.manual_seed(5)
    expected = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(model_dir)).state_dict()
    model = build_hf_model(model_dir, tp_group=None, dtype=torch.float32, device=torch.device("cpu"), seed=0,
                           overlap=None)
    got = model.model.state_dict()
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    pickled = _model_dir(tmp_path / "p", weights=False)
    torch.save({}, os.path.join(pickled, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="only pickled weights .*Convert them to safetensors"):
        build_hf_model(pickled, tp_group=None, dtype=torch.float32, device=torch.device("cpu"), seed=0, overlap=None)

    ids = load_tokenizer(model_dir).encode("def f(x): return x").tolist()
    assert ids and max(ids) < VOCAB
    ref = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    assert ids == ref.encode("def f(x): return x", add_special_tokens=False).ids
    os.remove(os.path.join(model_dir, "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer.json does not exist"):
        load_tokenizer(model_dir)


# ---- issue 24 item 7: config.json fields and weight files checked before any process starts ----


@pytest.mark.parametrize("kv", [-2, 0, 3, 2.0, "2"])
def test_bad_num_key_value_heads_is_one_config_error(tmp_path, kv):
    """Negative (-2 passed every `% tp` check), zero (`or heads` replaced it silently; the
    model then divided by it), non-dividing or non-int num_key_value_heads: one line naming
    the field and what it must be, from the pre-start config check."""
    model_dir = _model_dir(tmp_path, weights=False)
    _edit_config(model_dir, num_key_value_heads=kv)
    msg = precheck(["+model=hf", f"model.path={model_dir}", "parallel.tp=2"], CONFIG_DIR, 2)
    assert msg is not None and "\n" not in msg, msg
    assert f"num_key_value_heads must be a positive int dividing num_attention_heads (4), got {kv!r}" in msg, msg


def test_tp_not_dividing_num_key_value_heads_names_config_field(tmp_path):
    model_dir = _model_dir(tmp_path, weights=False, kv_heads=1)
    msg = precheck(["+model=hf", f"model.path={model_dir}", "parallel.tp=2"], CONFIG_DIR, 2)
    assert msg is not None and "parallel.tp (2) must divide model.num_query_groups (1)" in msg, msg
    assert "num_key_value_heads in" in msg and "config.json" in msg and "whole key/value heads" in msg, msg


@pytest.mark.parametrize("field,value", [("hidden_size", 2**20), ("vocab_size", 10**9), ("num_hidden_layers", 10**6),
                                         ("intermediate_size", 2**40), ("max_position_embeddings", 2**40)])
def test_absurd_sizes_refused_before_allocation(tmp_path, field, value):
    model_dir = _model_dir(tmp_path, weights=False)
    _edit_config(model_dir, **{field: value})
    with pytest.raises(ValueError, match=rf"{field} = {value} is above the sane bound"):
        compose(["+model=hf", f"model.path={model_dir}"])


def test_model_larger_than_memory_refused_with_its_size(tmp_path, monkeypatch):
    """Sizes each within bounds whose product cannot be allocated: refused with the count."""
    model_dir = _model_dir(tmp_path, weights=False)
    fields = hf_module.gpt_fields(model_dir)
    params = hf_module.parameter_count(fields, 32 // 4)
    monkeypatch.setattr(hf_module, "_host_memory_bytes", lambda: params * 2 - 1)
    with pytest.raises(ValueError, match=rf"the model has {params:,} parameters, .* more than this machine's memory"):
        compose(["+model=hf", f"model.path={model_dir}"])
    monkeypatch.setattr(hf_module, "_host_memory_bytes", lambda: params * 2)
    compose(["+model=hf", f"model.path={model_dir}"])  # exactly fits in bfloat16


def test_integer_safetensors_tensor_refused_not_cast(tmp_path):
    """transformers cast an int8 tensor to float (no scales): the model loaded garbage."""
    from safetensors.torch import load_file, save_file

    model_dir = _model_dir(tmp_path, weights=True, seed=1)
    file = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype I8; only float weights"):
        compose(["+model=hf", f"model.path={model_dir}"])
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype I8"):
        build_hf_model(model_dir, tp_group=None, dtype=torch.float32, device=torch.device("cpu"), seed=0, overlap=None)
    # A BOOL mask buffer (Pythia's attention.bias) is not a weight: still loads.
    tensors[name] = tensors[name].float()
    tensors["model.layers.0.self_attn.bias"] = torch.ones(4, 4, dtype=torch.bool)
    save_file(tensors, file, metadata={"format": "pt"})
    compose(["+model=hf", f"model.path={model_dir}"])
    tensors[name] = tensors[name].to(torch.int64)  # ... but an integer .weight is refused
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype I64"):
        compose(["+model=hf", f"model.path={model_dir}"])


def _sharded_to(model_dir: str, target: str) -> None:
    """Move model.safetensors to ``target`` and write an index whose entries name ``target``."""
    from safetensors.torch import load_file

    file = os.path.join(model_dir, "model.safetensors")
    names = sorted(load_file(file))
    os.makedirs(os.path.dirname(os.path.join(model_dir, target)), exist_ok=True)
    shutil.move(file, os.path.join(model_dir, target))
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: target for n in names}}, f)


@pytest.mark.parametrize("where", ["parent", "absolute", "subdir"])
def test_index_entries_outside_model_path_refused(tmp_path, where):
    model_dir = _model_dir(tmp_path / "model", weights=True, seed=2)
    outside = str(tmp_path / "elsewhere" / "model-00001-of-00001.safetensors")
    target = {"parent": "../elsewhere/model-00001-of-00001.safetensors", "absolute": outside,
              "subdir": "sub/model-00001-of-00001.safetensors"}[where]
    _sharded_to(model_dir, target)
    with pytest.raises(ValueError, match=r"weight_map\[.*\] = .* must be a file name in .*refusing to load weights"):
        compose(["+model=hf", f"model.path={model_dir}"])


def test_weight_symlink_leaving_model_path_refused(tmp_path):
    model_dir = _model_dir(tmp_path / "model", weights=True, seed=2)
    os.makedirs(tmp_path / "elsewhere")
    outside = str(tmp_path / "elsewhere" / "w.safetensors")
    shutil.move(os.path.join(model_dir, "model.safetensors"), outside)
    os.symlink(outside, os.path.join(model_dir, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors resolves to .*elsewhere/w.safetensors, outside"):
        compose(["+model=hf", f"model.path={model_dir}"])
    # The same link named by an index entry in the directory: refused too.
    _sharded_to(model_dir, "model.safetensors")
    with pytest.raises(ValueError, match=r"outside .*refusing to load weights from outside the model directory"):
        compose(["+model=hf", f"model.path={model_dir}"])


def test_deeply_nested_config_json_is_a_config_error(tmp_path):
    """Issue 24 item 8: config.json nested 50 000 deep raised RecursionError."""
    model_dir = _model_dir(tmp_path, weights=False)
    with open(os.path.join(model_dir, "config.json"), "wb") as f:
        f.write(b"[" * 50_000 + b"]" * 50_000)
    msg = precheck(["+model=hf", f"model.path={model_dir}"], CONFIG_DIR, 1)
    assert msg is not None and "config.json is JSON nested too deeply" in msg, msg


def test_export_hf_is_checked_before_start_and_never_writes_into_an_existing_path(tmp_path):
    model_dir = _model_dir(tmp_path / "model", weights=False)
    base = ["+model=hf", f"model.path={model_dir}"]
    (tmp_path / "taken").mkdir()
    os.symlink(tmp_path / "taken", tmp_path / "planted")
    for path in ("taken", "planted"):
        msg = precheck([*base, f"checkpoint.export_hf={tmp_path / path}"], CONFIG_DIR, 1)
        assert msg is not None and "already exists; expected a new path" in msg, msg
    msg = precheck(["+model=gpt", f"checkpoint.export_hf={tmp_path / 'new'}"], CONFIG_DIR, 1)
    assert msg is not None and "needs +model=hf" in msg, msg
    msg = precheck([*base, f"checkpoint.export_hf={tmp_path / 'new'}", "parallel.tp=1", "parallel.dp_shard=2"], CONFIG_DIR, 2)
    assert msg is not None and "needs parallel.dp_shard=1" in msg, msg
    # A link planted after the check: the export checks again before it writes (one ValueError).
    with pytest.raises(ValueError, match="planted already exists; expected a new path"):
        export_hf_directory(torch.nn.Linear(1, 1), None, True, str(tmp_path / "planted"))
    assert os.listdir(tmp_path / "taken") == []

