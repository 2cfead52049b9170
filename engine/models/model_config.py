"""ModelConfig: the architecture facts the engine needs, read from an HF config.json dict."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# architecture name -> what differs from plain Llama. The *Model names are the same decoders saved without an LM
# head (transformers' AutoModel; embedding models such as Qwen3-Embedding): they run only as pooling models.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "LlamaModel": {"no_lm_head": True},
    "MistralModel": {"no_lm_head": True},
    "Qwen2Model": {"attention_bias": True, "no_lm_head": True},
    "Qwen3Model": {"qk_norm": True, "no_lm_head": True},
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    sliding_window: int | None = None

    @property
    def has_lm_head(self) -> bool:
        """False for the *Model architectures (no LM head: they can only pool, never generate)."""
        return not SUPPORTED_ARCHITECTURES[self.architecture].get("no_lm_head", False)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        arch = supports(d)
        traits = SUPPORTED_ARCHITECTURES[arch]
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope = dict(d.get("rope_parameters") or {})  # transformers >= 5
        legacy = d.get("rope_scaling") or None  # transformers 4
        if legacy:
            rope = {**legacy, **rope}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos: list[int] = []
        for src in (d, generation_config or {}):
            val = src.get("eos_token_id")
            for t in val if isinstance(val, list) else [val]:
                if isinstance(t, int) and t not in eos:
                    eos.append(t)
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", traits.get("attention_bias", False))),
            qk_norm=traits.get("qk_norm", False),
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None,
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        gen_path = os.path.join(model_dir, "generation_config.json")
        gen = None
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_hf_dict(d, gen)


def supports(hf_config: dict[str, Any]) -> str:
    """The supported architecture this config names, or an UnsupportedModelError listing the supported ones."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = hf_config.get("model_type")
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
    if not archs and model_type in by_type:
        return by_type[model_type]
    name = ", ".join(archs) or f"model_type={model_type!r}"
    raise UnsupportedModelError(
        f"unsupported model architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
