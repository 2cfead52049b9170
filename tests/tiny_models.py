"""Tiny random Llama-family models and an offline-trained tokenizer for tests.

Nothing here touches a model hub. `build_tokenizer` trains a byte-level BPE on a built-in corpus;
`build_tiny_model` writes a Hugging Face directory (config, safetensors, tokenizer, generation config)
whose random weights are scaled up so that greedy decoding has clear winners: the top-2 logit gap has a
median of ~0.45 and is below 1e-3 in only ~0.1-0.2% of steps (float32 noise is ~3e-5). Tests compare the
engine's greedy ids with `hf_greedy_with_logits` (transformers) through `assert_greedy_close`, which
forgives a divergence only at such a near-tie.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

ARCHS: tuple[str, ...] = ("llama", "llama3", "qwen2", "qwen3", "mistral")
SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 512
INIT_STD = 0.25  # linear / embedding weights; large enough for peaky logits, small enough for variety
NORM_STD = 0.1  # RMSNorm weights are 1 + NORM_STD * N(0, 1)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SUBJECTS = ["The cat", "A small dog", "My friend", "The engineer", "Our team", "She", "He", "They",
             "The old man", "A young girl", "The server", "This model", "Every student", "The robot"]
_VERBS = ["reads", "writes", "likes", "builds", "finds", "sees", "carries", "tests", "answers",
          "explains", "counts", "paints", "opens", "sends"]
_OBJECTS = ["a book", "the letter", "three apples", "the code", "a long story", "the red door",
            "twelve boxes", "the answer", "a question", "the blue sky", "an email", "the report"]
_ENDINGS = ["today.", "every morning.", "at 9:30 am.", "in the garden.", "before lunch!",
            "with great care.", "on Monday?", "after the rain.", "for 42 minutes.", "quickly, again."]
_CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
             ("Japan", "Tokyo"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Peru", "Lima"),
             ("Norway", "Oslo"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("India", "New Delhi")]
_EXTRA = ["Le café est très bon.", "A naïve approach works.", "日本語のテキストです。", "Hello 🙂 world!",
          "Ünïcödé text: ä ö ü ß é è ñ ç.", "Привет, мир!", "Good job 👍🚀", "x = (a + b) * 3; # math",
          "def add(x, y): return x + y", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024.",
          "Email me at user@example.com, please.", "\"Quotes\" and 'apostrophes' - dashes -- ok..."]


def build_corpus(n_sentences: int = 400, seed: int = 0) -> list[str]:
    """A deterministic English-ish corpus with Q&A lines, digits, punctuation and multi-byte text."""
    rng = random.Random(seed)
    lines = list(_EXTRA)
    for country, capital in _CAPITALS:
        lines.append(f"What is the capital of {country}? {capital}.")
        lines.append(f"The capital of {country} is {capital}.")
    while len(lines) < n_sentences:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        if rng.random() < 0.2:
            sentence += f" Item #{rng.randint(0, 9999)} costs ${rng.randint(1, 99)}.{rng.randint(0, 99):02d}"
        if rng.random() < 0.1:
            sentence += " " + rng.choice(_EXTRA)
        lines.append(sentence)
    return lines


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    return tok.to_str()


def build_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train (once per process) a ~512-token byte-level BPE with ChatML specials; save it into out_dir."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [PAD_ID, BOS_ID, EOS_ID]
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def make_config(arch: str, vocab_size: int, **overrides: Any) -> PretrainedConfig:
    """The tiny config of one arch: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), head_dim 16."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    if arch == "llama":
        return LlamaConfig(**{**common, "tie_word_embeddings": True, **overrides})
    if arch == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**{**common, "tie_word_embeddings": False, "rope_parameters": rope, **overrides})
    if arch == "qwen2":  # Qwen2 always has q/k/v biases
        return Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
    if arch == "qwen3":  # Qwen3 has per-head q_norm / k_norm
        return Qwen3Config(**{**common, "tie_word_embeddings": True, **overrides})
    if arch == "mistral":  # no sliding window: it could never act at 512 positions anyway
        return MistralConfig(**{**common, "tie_word_embeddings": False, "sliding_window": None, **overrides})
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


@torch.no_grad()
def init_peaky_(model: PreTrainedModel, seed: int, std: float = INIT_STD) -> None:
    """Overwrite every parameter: weights N(0, std), norm weights 1 + N(0, NORM_STD), biases N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            param.copy_(1.0 + NORM_STD * noise)
        else:
            param.copy_(std * noise)


def build_tiny_model(out_dir: str | Path, arch: str, *, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random float32 model of `arch` (see ARCHS) plus tokenizer to out_dir; return the dir.

    `overrides` go into the config (e.g. num_hidden_layers=4). qwen2 is saved in several safetensors
    shards with an index json, the others in one file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config = make_config(arch, len(tokenizer), **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_peaky_(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(str(out), max_shard_size="200KB" if arch == "qwen2" else "50GB")
    return str(out)


POOLING_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def build_tiny_embedding_model(out_dir: str | Path, arch: str, *, pooling: str = "LAST", normalize: bool = True,
                               sentence_transformers: bool = True, matryoshka_dimensions: list[int] | None = None,
                               seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random float32 embedding model: transformers' AutoModel of `arch` (Qwen3Model, LlamaModel, ...:
    the decoder without an LM head, saved without the "model." prefix) plus tokenizer; return the dir.

    `sentence_transformers`: also write modules.json, 1_Pooling/config.json (`pooling`: LAST | MEAN | CLS) and,
    if `normalize`, a Normalize module, as sentence-transformers saves them. `matryoshka_dimensions`: written
    into config.json ([] means any length; None: the model does not allow shorter vectors).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config = make_config(arch, len(tokenizer), **overrides)
    if matryoshka_dimensions is not None:
        config.is_matryoshka = True
        config.matryoshka_dimensions = list(matryoshka_dimensions)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModel.from_config(config, dtype=torch.float32)
    init_peaky_(model, seed)
    model.save_pretrained(str(out))
    if sentence_transformers:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
            (out / "2_Normalize").mkdir(exist_ok=True)
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_Pooling").mkdir(exist_ok=True)
        modes = {mode: kind == pooling for kind, mode in POOLING_MODES.items()}
        (out / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": config.hidden_size, "pooling_mode_max_tokens": False,
             "include_prompt": True, **modes}, indent=2))
    return str(out)


@torch.no_grad()
def hf_embeddings(model_dir: str | Path, prompt_token_ids: list[list[int]], pooling: str, normalize: bool,
                  dimensions: int | None = None) -> torch.Tensor:
    """transformers' reference: AutoModel (float32; the base model of a ForCausalLM checkpoint too) on each prompt
    alone, last_hidden_state pooled (LAST | MEAN | CLS), cut to `dimensions`, then L2-normalized if asked."""
    model = load_hf_base_model(str(model_dir))
    rows = []
    with one_thread():
        for prompt in prompt_token_ids:
            hidden = model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()
            vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
            if dimensions is not None:
                vec = vec[:dimensions]
            rows.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return torch.stack(rows)


@functools.lru_cache(maxsize=8)
def load_hf_base_model(model_dir: str) -> PreTrainedModel:
    """transformers' float32 AutoModel (no LM head) for model_dir (cached by path: do not mutate it)."""
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=8)
def load_hf_model(model_dir: str) -> PreTrainedModel:
    """transformers' float32 model for model_dir (cached by path: do not mutate it or rebuild that dir)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # never stop early: always max_new_tokens
    return model.eval()


def copy_with_eos(model_dir: str | Path, out_dir: str | Path, eos: int) -> str:
    """A copy of a tiny model whose EOS is token `eos` (same weights): a regular token, so that its text shows."""
    shutil.copytree(model_dir, out_dir)
    for name in ("config.json", "generation_config.json"):
        path = Path(out_dir) / name
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = eos
        path.write_text(json.dumps(cfg))
    return str(out_dir)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models run 10x faster on one thread than on several when other processes share the CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_engine_idle(llm) -> None:
    """Nothing left in the engine of an LLM: no request, nothing scheduled, every KV block free and unshared."""
    engine = llm.engine
    bm = engine.block_manager
    assert engine.requests == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@torch.no_grad()
def hf_greedy_with_logits(
    model_dir: str | Path, prompt_token_ids: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-decode each prompt alone (no padding, no EOS stop) with transformers.

    Returns the new token ids per prompt and the raw logits per prompt, shape [max_new_tokens, vocab].
    """
    model = load_hf_model(str(model_dir))
    all_ids: list[list[int]] = []
    all_logits: list[torch.Tensor] = []
    with one_thread():
        for prompt in prompt_token_ids:
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                return_dict_in_generate=True, output_logits=True,
            )
            new_ids = out.sequences[0, len(prompt):].tolist()
            assert len(new_ids) == max_new_tokens, (len(new_ids), max_new_tokens)
            all_ids.append(new_ids)
            all_logits.append(torch.cat(out.logits, dim=0).float())
    return all_ids, all_logits


def hf_greedy(model_dir: str | Path, prompt_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (exactly max_new_tokens new ids) of each prompt."""
    return hf_greedy_with_logits(model_dir, prompt_token_ids, max_new_tokens)[0]


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row of a [steps, vocab] tensor."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def random_prompts(n: int, seed: int = 0, min_len: int = 1, max_len: int = 64) -> list[list[int]]:
    """n prompts of random non-special token ids (ids 3..VOCAB_SIZE-1), lengths in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def assert_greedy_close(
    actual: list[list[int]], expected: list[list[int]], expected_logits: list[torch.Tensor], tol: float = 1e-3
) -> None:
    """Compare greedy ids of an implementation with transformers' (from `hf_greedy_with_logits`).

    Random logits have rare near-ties (about 0.1-0.2% of steps have a top-2 gap < 1e-3, float32 noise is
    ~3e-5), so a sequence may diverge at a step where transformers' logit of its own pick exceeds the logit of
    `actual`'s pick by at most `tol`; after such a step the rest of that sequence is not compared.
    """
    assert len(actual) == len(expected), f"{len(actual)} outputs, expected {len(expected)}"
    for i, (got, want, logits) in enumerate(zip(actual, expected, expected_logits)):
        assert len(got) == len(want), f"seq {i}: {len(got)} tokens, expected {len(want)}"
        for step, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            gap = float(logits[step, w] - logits[step, g])
            assert gap <= tol, (
                f"seq {i} step {step}: got token {g}, expected {w} (logit gap {gap:.3g} > tol {tol}); "
                f"got {got}, expected {want}"
            )
            break
