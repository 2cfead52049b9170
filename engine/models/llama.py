"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm) from kvgate layers, tensor
parallel (engine/models/parallel.py): each rank holds num_heads / TP query heads and its share of the KV heads (one
replicated KV head per rank where TP > num_kv_heads), and loads only its slices of the checkpoint; and pipeline
parallel: a stage holds its range of layers (stage_layers), the first one the embedding, the last one the final
norm and the LM head (a tied head loads the embedding's weights), and the others' layers are absent (None)."""
from __future__ import annotations

import os
import re
from typing import Any, Iterable

import torch
from torch import nn

from kvgate.engine.distributed.parallel_state import get_pp_group, get_tp_group
from kvgate.engine.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, fused_ops, silu_and_mul
from kvgate.engine.models.model_config import ModelConfig
from kvgate.engine.models.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding, check_shape, local_units)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        tp, self.head_dim = get_tp_group(), cfg.head_dim
        self.num_heads = local_units(cfg.num_attention_heads, tp)[1]  # this rank's
        self.num_kv_heads = local_units(cfg.num_key_value_heads, tp)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        heads = (cfg.num_attention_heads, cfg.head_dim)
        kv = (cfg.num_key_value_heads, cfg.head_dim)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [heads, kv, kv], bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(heads, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # one table shared by all layers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.fused = False  # the q/k norms and the rotary embedding in one Triton kernel (use_fused_ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.fused:
            q, k = fused_ops().qk_norm_rotary(positions, q, k, self.q_norm.weight, self.k_norm.weight,
                                              self.q_norm.eps, self.rotary.cos, self.rotary.sin)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rows = (cfg.intermediate_size, 1)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [rows, rows], bias=False)
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, bias=False)
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


def stage_layers(num_layers: int, num_stages: int, stage: int, partition: str | None = None) -> range:
    """The layers of pipeline stage `stage`: an even split, the first stages taking one more where it is uneven
    (3 layers on 2 stages: [0, 1] and [2]); or `partition`, the number of layers of each stage, comma-separated
    (default: $KVGATE_PP_LAYER_PARTITION, vLLM's VLLM_PP_LAYER_PARTITION; e.g. "17,13" to give the last stage,
    which also runs the LM head, fewer layers)."""
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers, the model has {num_layers}")
    partition = os.environ.get("KVGATE_PP_LAYER_PARTITION") if partition is None else partition
    if partition:
        try:
            sizes = [int(x) for x in partition.split(",")]
        except ValueError:
            sizes = []
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"the layer partition {partition!r} must give each of the {num_stages} pipeline "
                             f"stages at least one layer, {num_layers} in all")
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])
    per, extra = divmod(num_layers, num_stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (1 if stage < extra else 0))


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
        pp = get_pp_group()
        self.first_stage, self.last_stage = pp.is_first, pp.is_last
        self.layer_range = stage_layers(cfg.num_hidden_layers, pp.world_size, pp.rank)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.first_stage else None
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary) if i in self.layer_range else None
                                    for i in range(cfg.num_hidden_layers))
        self.local_layers = [self.layers[i] for i in self.layer_range]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.last_stage else None
        # the LM head: None where tied to the embedding on this stage. The CPU path may replace it by a packed
        # linear (world size 1); a tied head on a last stage without the embedding is a head of its own
        self.tied_head = cfg.tie_word_embeddings and not self.first_stage and self.last_stage and not pooling
        untied = (not cfg.tie_word_embeddings or self.tied_head) and not pooling and self.last_stage
        self.lm_head: nn.Module | None = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if untied else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final (normed) hidden states on the last stage; on the others (hidden, residual) for the next stage,
        which passes them back in as `intermediate`."""
        if self.first_stage:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate  # type: ignore[misc]
        for layer in self.local_layers:
            x, residual = layer(positions, x, residual)
        if not self.last_stage:
            return x, residual  # type: ignore[return-value]
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary (on every rank)."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if isinstance(head, VocabParallelEmbedding):
            return head.compute_logits(hidden).float()
        return head(hidden).float()  # a packed CPU head

    def _elsewhere(self, name: str) -> bool:
        """A checkpoint tensor that another pipeline stage holds."""
        if name.startswith("layers."):
            return int(name.split(".")[1]) not in self.layer_range
        return (name.startswith("embed_tokens.") and not self.first_stage) or \
            (name.startswith(("norm.", "lm_head.")) and not self.last_stage)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named tensors (or lazy safetensors slices) into the parameters, each rank its slice, q/k/v and
        gate/up into their fused parameters; every parameter must be written exactly once."""
        params = dict(self.named_parameters())
        pending = {name: set(range(3 if "qkv_proj" in name else 2 if "gate_up" in name else 1)) for name in params}
        for hf_name, tensor in weights:
            name = re.sub(r"^model\.", "", hf_name)
            if self.tied_head and name == "embed_tokens.weight":
                name = "lm_head.weight"  # this stage's head is the embedding of the first
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None) or self._elsewhere(name):
                continue
            shard, stacked = 0, False
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                (fused, shard), stacked = self._STACKED[parts[-2]], True
                name = ".".join(parts[:-2] + [fused, parts[-1]])
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.cfg.architecture}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    check_shape(tensor, param.shape)
                    param.data.copy_(tensor[:])
                elif stacked:  # q, k or v; gate or up
                    loader(param, tensor, shard)
                else:
                    loader(param, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {hf_name!r} {e}") from None
            pending[name].discard(shard)
        missing = sorted(n for n, left in pending.items() if left)  # (this stage's)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" …" if len(missing) > 8 else ""))
