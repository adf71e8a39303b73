"""Wrap a Hugging Face Llama for tensor parallelism and train a few steps (CPU or GPU).

    torchrun --nproc-per-node=2 examples/wrap_hf.py

A tiny random-init ``LlamaForCausalLM`` (no download); ``tp_fuse.layers.wrap`` picks the built-in
plan for ``config.model_type == "llama"`` and shards attention and MLP over the 2 ranks.
"""

import torch
import torch.distributed as dist
import transformers

import tp_fuse
from tp_fuse.layers import wrap
from tp_fuse.recipe import DelayedScaling

dist.init_process_group("gloo")  # "nccl" on GPUs
tp_group = dist.new_group(list(range(dist.get_world_size())))
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)  # every rank builds the same full model; wrap keeps this rank's shards
model = transformers.LlamaForCausalLM(config)
wrap(model, tp_group, verbose=True)  # prints what was converted and what was left as it is

opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
for step in range(5):
    with tp_fuse.autocast(recipe=DelayedScaling(), amax_reduction_group=tp_group):  # FP8; leave out for fp32
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
print(f"rank {dist.get_rank()}: q_proj weight {tuple(model.model.layers[0].self_attn.q_proj.weight.shape)}, "
      f"state_dict keys unchanged: {'model.layers.0.self_attn.q_proj.weight' in model.state_dict()}")
dist.destroy_process_group()
