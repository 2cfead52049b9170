"""Load the tokenizer that belongs to a model (HF directory or GGUF file), offline."""
from __future__ import annotations

import os

from kvgate.engine.config import EngineConfig


def load_tokenizer(config: EngineConfig):
    """A transformers fast tokenizer; special-token ids agree with the model's config."""
    path = config.args.tokenizer or config.model_path
    if config.load_format == "gguf" and not config.args.tokenizer:
        from kvgate.engine.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        if config.load_format == "dummy":
            raise ValueError(f"no tokenizer in {path}: pass skip_tokenizer_init=True to run dummy weights on "
                             f"token ids") from e
        raise ValueError(f"cannot load the tokenizer from {path}: {e}") from e


def eos_token_ids(config: EngineConfig, tokenizer) -> list[int]:
    """The token ids that end a sample (unless ignore_eos): the model config's, else the tokenizer's EOS."""
    eos = list(config.model_config.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    return eos
