"""AdamW and its learning-rate schedule (linear warmup, cosine decay)."""

from __future__ import annotations

import math

import torch

from .config import OptimConfig

__all__ = ["build_optimizer", "lr_at", "set_lr"]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) and none on biases and norm weights.

    Parameter order is ``model.named_parameters()`` order, identical on every rank and
    at every TP size (checkpoints key optimizer state by parameter name anyway).
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: one kernel per tensor, the same arithmetic on every device count.
    # capturable: step counts on the device, no host read in the update (CUDA graphs).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False,
                             capturable=cfg.capturable)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate of (1-based) ``step``.

    ``lr * step / warmup_steps`` during warmup, then cosine from ``lr`` down to
    ``min_lr`` at ``max_steps``.
    """
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
