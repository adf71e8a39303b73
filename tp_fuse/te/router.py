"""Transformer Engine's ``transformer_engine.pytorch.router``: the fused MoE-router kernels'
names, which Megatron-Core imports when it imports (``extensions/transformer_engine.py``) and
calls only with ``moe_router_fusion=True``.

tp_fuse has no fused router: each function raises ``NotImplementedError`` naming itself when
called (Megatron's unfused router, ``moe_router_fusion=False``, is the plain-torch path).
Nothing here returns a value.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_topk_with_score_function"]


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"transformer_engine.pytorch.router.{name}: tp_fuse has no fused MoE router; "
        "use Megatron's unfused router (moe_router_fusion=False)")


def fused_topk_with_score_function(*args: Any, **kwargs: Any) -> NoReturn:
    """TE's fused top-k routing: not implemented (see the module docstring)."""
    _refuse("fused_topk_with_score_function")


def fused_compute_score_for_moe_aux_loss(*args: Any, **kwargs: Any) -> NoReturn:
    """TE's fused aux-loss scores: not implemented (see the module docstring)."""
    _refuse("fused_compute_score_for_moe_aux_loss")


def fused_moe_aux_loss(*args: Any, **kwargs: Any) -> NoReturn:
    """TE's fused MoE aux loss: not implemented (see the module docstring)."""
    _refuse("fused_moe_aux_loss")
