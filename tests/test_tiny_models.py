"""The tiny test models themselves: they build, load in transformers and decode greedily with variety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tiny_models import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    assert_greedy_close,
    build_tiny_model,
    hf_greedy,
    hf_greedy_with_logits,
    random_prompts,
    top2_gaps,
)

TEXTS = ["What is the capital of France? Paris.", "café, naïve, 日本語 🙂🚀", "  two  spaces\n\ttab 123!"]


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_loads_in_transformers(tiny_model_dirs: dict[str, str], arch: str) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dirs[arch])
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert config.tie_word_embeddings == (arch in ("llama", "qwen3"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32)
    assert model.lm_head.weight.shape == (config.vocab_size, 64)
    with torch.no_grad():
        logits = model(torch.tensor([[BOS_ID, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()
    assert json.loads((Path(tiny_model_dirs[arch]) / "generation_config.json").read_text())["eos_token_id"] == EOS_ID


def test_arch_specific_features(tiny_model_dirs: dict[str, str]) -> None:
    rope = AutoConfig.from_pretrained(tiny_model_dirs["llama3"]).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 64
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"])
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"])
    assert hasattr(qwen3.model.layers[0].self_attn, "q_norm")


def test_qwen2_is_sharded(tiny_model_dirs: dict[str, str]) -> None:
    model_dir = Path(tiny_model_dirs["qwen2"])
    shards = sorted(model_dir.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}


def test_build_is_deterministic(tmp_path: Path, tiny_llama: str) -> None:
    again = build_tiny_model(tmp_path / "again", "llama")
    assert (Path(again) / "model.safetensors").read_bytes() == (Path(tiny_llama) / "model.safetensors").read_bytes()
    assert (Path(again) / "tokenizer.json").read_bytes() == (Path(tiny_llama) / "tokenizer.json").read_bytes()


def test_overrides_reach_config(tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(build_tiny_model(tmp_path, "mistral", num_hidden_layers=3))
    assert config.num_hidden_layers == 3


def test_tokenizer_round_trip_and_specials(tiny_llama: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [PAD_ID, BOS_ID, EOS_ID]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert len(tok.encode("The cat reads a book today.")) < 10  # merges were learned
    assert len(tok.encode("日本語")) > 3  # multi-byte characters span several byte tokens


def test_chat_template(tiny_llama: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_greedy_is_peaky_and_varied(tiny_model_dirs: dict[str, str], arch: str) -> None:
    prompts = random_prompts(6, seed=1, max_len=48)
    ids, logits = hf_greedy_with_logits(tiny_model_dirs[arch], prompts, max_new_tokens=20)
    assert [len(x) for x in ids] == [20] * len(prompts)
    assert hf_greedy(tiny_model_dirs[arch], prompts[:2], 20) == ids[:2]
    gaps = torch.cat([top2_gaps(x) for x in logits])
    assert (gaps > 1e-3).float().mean() > 0.97
    assert len({t for seq in ids for t in seq}) > 40  # not collapsed onto a few tokens
    assert_greedy_close(ids, ids, logits)


def test_assert_greedy_close_tolerates_only_near_ties() -> None:
    logits = torch.zeros(3, 8)
    logits[:, 1] = 5.0
    logits[1, 2] = 5.0 - 1e-4  # a near-tie at step 1
    assert_greedy_close([[1, 2, 7]], [[1, 1, 1]], [logits])
    with pytest.raises(AssertionError):
        assert_greedy_close([[3, 1, 1]], [[1, 1, 1]], [logits])
