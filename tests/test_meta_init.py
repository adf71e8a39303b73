"""Meta-device initialization (single process): ``GPT(device="meta")`` + ``materialize``
gives exactly the eagerly built model (parameters, buffers, dropout streams). The
TP x FSDP cases (only local shards materialized) are in ``tests/test_fsdp.py``."""

from __future__ import annotations

import pytest
import torch

from tp_fuse.layers import GPT, GPTConfig, TransformerLayer
from tp_fuse.layers.meta_init import deferred_inits, materialize

SMALL = dict(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=2, num_heads=4, hidden_dropout=0.1,
             attention_dropout=0.1)
LLAMA = dict(SMALL, activation="swiglu", normalization="RMSNorm", position_embedding="rope",
             num_query_groups=2, tie_embeddings=False, bias=False)


@pytest.mark.parametrize("cfg", [SMALL, LLAMA], ids=["gpt", "llama"])
def test_meta_init_equals_eager(cfg: dict) -> None:
    eager = GPT(GPTConfig(**cfg), seed=11)
    meta = GPT(GPTConfig(**cfg), seed=11, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, "cpu")
    e_state, m_state = eager.state_dict(), meta.state_dict()
    assert e_state.keys() == m_state.keys()
    for k, v in e_state.items():
        assert not m_state[k].is_meta, k
        torch.testing.assert_close(m_state[k], v, rtol=0, atol=0, msg=k)
    for (name, b), (_, mb) in zip(eager.named_buffers(), meta.named_buffers()):
        torch.testing.assert_close(mb, b, rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    # Same dropout masks too (training mode, dropout on): the streams restarted from the seed.
    torch.testing.assert_close(meta(tokens, tokens), eager(tokens, tokens), rtol=0, atol=0)


def test_meta_init_errors() -> None:
    with pytest.raises(ValueError, match="needs a seed"):
        TransformerLayer(32, 64, 4, seed=None, device="meta")
    model = GPT(GPTConfig(**SMALL), seed=1, device="meta")
    with pytest.raises(ValueError, match="real device"):
        materialize(model, "meta")
    bare = torch.nn.Module()
    bare.w = torch.nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="no deferred initialization"):
        deferred_inits(bare)
