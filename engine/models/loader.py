"""Build the model and fill its weights: a local HF directory (safetensors), a GGUF file, or dummy weights."""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Iterator

import torch

from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.model_config import ModelConfig


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return [os.path.join(model_dir, n) for n in names]


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every checkpoint tensor: a tensor-parallel rank reads only the rows or columns it
    holds (engine/models/parallel.py)."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot read weights file {path}: {e}") from e


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights (norms 1.0): each parameter's full tensor is drawn from a generator seeded by `seed` and the
    parameter's name, on the CPU for a model on the CPU and on the GPU for one on CUDA (at 70B sizes the CPU would
    take minutes), so the numbers depend on neither the GPU nor the tensor- or pipeline-parallel sizes (a stage
    draws only its own parameters; a tied head drawn as the embedding), and each rank keeps its slice."""
    step = 1 << 24
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
            continue
        drawn_as = "embed_tokens.weight" if name == "lm_head.weight" and getattr(model, "tied_head", False) else name
        device = p.device if p.device.type == "cuda" else torch.device("cpu")
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(drawn_as.encode()))
        loader = getattr(p, "weight_loader", None)
        full_shape = getattr(p, "full_shape", tuple(p.shape))
        full = p.data if loader is None else torch.empty(full_shape, dtype=p.dtype, device=device)
        flat = full.view(-1)
        for i in range(0, flat.numel(), step):  # in chunks: no float32 copy of a whole large tensor
            n = min(step, flat.numel() - i)
            flat[i:i + n].copy_(torch.randn(n, generator=gen, device=device) * 0.02)
        if loader is not None:
            loader(p, full)


def get_model(cfg: ModelConfig, model_path: str, load_format: str, dtype: torch.dtype,
              device: torch.device, seed: int = 0, pooling: bool = False) -> LlamaForCausalLM:
    """The model with its weights. `pooling`: built without an LM head (the pooling runner; EngineConfig refuses
    to generate with a checkpoint that has none, a *Model architecture)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, pooling=pooling)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        if load_format == "dummy":
            _init_dummy(model, seed)
        elif load_format == "gguf":
            from kvgate.engine.models.gguf import iter_gguf_weights

            model.load_weights(iter_gguf_weights(model_path))
        else:
            model.load_weights(iter_safetensors(model_path))
    return model.eval()
