"""Rotary position embeddings (RoPE), Megatron-LM's non-interleaved ("rotate half") form."""

from __future__ import annotations

import torch

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for RoPE over the full head dimension.

    ``inv_freq[i] = theta^(-2i/d)`` for ``i < d/2``; the angle of position ``p`` is
    ``p * inv_freq`` repeated twice (``[f, f]``), matching ``rotate_half`` pairing
    ``x[i]`` with ``x[i + d/2]``.

    Shapes: ``cos_sin(s)`` returns ``cos, sin`` of shape ``[s, 1, 1, d]`` (broadcast
    over batch and heads of ``[s, b, n, d]`` activations).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        if not theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {theta}")
        self.head_dim = head_dim
        self.theta = float(theta)
        # Not persistent: derived from (head_dim, theta), no checkpoint entry needed.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        d = self.head_dim
        return (1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float()  # [d/2]

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in place (after ``to_empty`` from the meta device)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._inv_freq())

    def cos_sin(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(device))  # [s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [s, d]
        return emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]  # [s, 1, 1, d]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [s, b, n, d]``; math in float32."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
