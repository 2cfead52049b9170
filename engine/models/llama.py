"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm) from kvgate layers."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from kvgate.engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, fused_ops, silu_and_mul
from kvgate.engine.models.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # one table shared by all layers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = fused_ops().silu_and_mul if self.fused else silu_and_mul
        return self.down_proj(act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our parameter name, shard index) for the fused projections
    _STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, pooling: bool = False) -> None:
        """`pooling`: the decoder alone (an embedding model): no LM head is built, a checkpoint's lm_head.weight is
        ignored, and compute_logits must not be called. Checkpoints without the "model." prefix (the *Model
        architectures) load the same way."""
        super().__init__()
        self.cfg = cfg
        self.pooling = pooling
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        untied = not cfg.tie_word_embeddings and not pooling
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied embeddings
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused == "qkv_proj":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [q, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be written exactly once."""
        params = dict(self.named_parameters())
        pending = {name: set(range(3 if "qkv_proj" in name else 2 if "gate_up" in name else 1)) for name in params}
        for hf_name, tensor in weights:
            name = re.sub(r"^model\.", "", hf_name)
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            shard = 0
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, shard = self._STACKED[parts[-2]]
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.cfg.architecture}")
            param = params[name]
            target = param.data
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
                sizes = self._shard_sizes(name.split(".")[-2])
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            pending[name].discard(shard)
        missing = sorted(n for n, left in pending.items() if left)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" …" if len(missing) > 8 else ""))
