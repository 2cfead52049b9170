"""kvgate's model layers: RMSNorm, rotary embedding (incl. Llama-3 scaling), gated SiLU, paged attention."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.engine.forward_context import get_forward_context


def fused_ops() -> Any:
    """kvgate.kernels.triton_fused, imported on first use (it imports triton)."""
    from kvgate.kernels import triton_fused

    return triton_fused


def use_fused_ops(model: nn.Module, on: bool = True) -> None:
    """Run RMSNorm, rotary and SiLU-and-mul through the fused Triton kernels (the GPU path); off: torch."""
    for m in model.modules():
        if hasattr(m, "fused"):
            m.fused = on


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`: returns (norm(x + residual), x + residual)."""
        if self.fused:
            return fused_ops().rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # normalized in float32 and rounded to x's dtype, then scaled by the weight in that dtype: transformers'
        # arithmetic exactly, in two ops
        out = self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as HF Llama/Qwen apply it."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)
        self.fused = False

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused: rotates q and k in place."""
        if self.fused:
            return fused_ops().rotary(positions, q, k, self.cos, self.sin)
        if self._step is None or self._step[0] is not positions:  # one lookup per step, shared by all layers
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, d/2]
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)
            self._step = (positions, cos, sin)
        _, cos, sin = self._step
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class PagedAttention(nn.Module):
    """Stores this step's K/V in the layer's paged cache and attends through the selected backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = torch.empty(0)  # bound by the model runner once the cache exists
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        return ctx.attention_fn(q, k, v, self.k_cache, self.v_cache, ctx.attn_metadata, self.scale)
