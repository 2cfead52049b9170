"""A model directory for serving benchmarks with dummy weights: the config of a real model plus a synthetic
tokenizer, so that the gateway can stream text for random token ids without the model's real tokenizer (no model
hub here).

Two kinds:
- word-level (the default): one distinct piece per id ("t0", "t1", ...), joined with spaces;
- `--byte-level`: a byte-level BPE vocabulary of the model's size (the 256 byte symbols, then generated word
  pieces, with and without a leading space, and JSON punctuation runs; the config's bos/eos ids are special
  tokens), as real chat models have. Guided decoding needs it: a grammar can only be matched by tokens whose text
  spells it, and the word-level pieces spell no JSON. (Encoding produces single bytes: it has no merges; only
  decoding, the grammar's view, is realistic.)

  python benchmarks/dummy_tokenizer.py benchmarks/configs/qwen3-0.6b /tmp/qwen3-0.6b-dummy
  python benchmarks/dummy_tokenizer.py --byte-level benchmarks/configs/qwen3-0.6b /tmp/qwen3-0.6b-bytes
  kvgate serve --model /tmp/qwen3-0.6b-dummy --load-format dummy
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (the byte-level BPE alphabet: space is "Ġ", newline "Ċ", ...)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_vocab(vocab_size: int, special_ids: list[int], seed: int = 0) -> dict[str, int]:
    """vocab_size distinct byte-level pieces: the 256 bytes, JSON punctuation runs, then random lowercase pieces
    of 2-8 letters (half with a leading space), every special id left for a special token."""
    sym = byte_symbols()
    enc = lambda text: "".join(sym[b] for b in text.encode())  # noqa: E731
    pieces = [sym[b] for b in range(256)]
    punct = ['{"', '"}', '":', '",', ',"', '":"', '","', '"]', '["', '},{', '":{', '":[', '}}', ']}', '},',
             '":true', '":false', '":null', '":0', '":1', ' {', ' "', '\n', '  ', '    ']
    seen = set(pieces)
    for p in map(enc, punct):
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    need = vocab_size - len(special_ids)
    for n in itertools.count():
        if len(pieces) >= need:
            break
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        piece = enc((" " if n % 2 else "") + word)
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    ids = [i for i in range(vocab_size) if i not in set(special_ids)]
    return dict(zip(pieces, ids))


def main(config_dir: str, out_dir: str, byte_level: bool = False) -> None:
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(config_dir, "config.json"), out_dir)
    with open(os.path.join(config_dir, "config.json")) as f:
        config = json.load(f)
    vocab_size = config["vocab_size"]
    if not byte_level:
        vocab = {f"t{i}": i for i in range(vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins pieces with spaces
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out_dir)
        print(f"wrote {out_dir} (word-level, vocab {vocab_size})")
        return
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    bos = config.get("bos_token_id")
    special = sorted({i for i in [*eos_ids, bos] if i is not None and i < vocab_size})
    vocab = byte_level_vocab(vocab_size, special)
    names = {i: f"<|special_{i}|>" for i in special}
    for i, name in names.items():
        vocab[name] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(names[i], special=True) for i in special])
    kw = {}
    if eos_ids:
        kw["eos_token"] = names[eos_ids[0]]
    if bos is not None and bos in names:
        kw["bos_token"] = names[bos]
    PreTrainedTokenizerFast(tokenizer_object=tok, **kw).save_pretrained(out_dir)
    print(f"wrote {out_dir} (byte-level, vocab {vocab_size})")


if __name__ == "__main__":
    argv = sys.argv[1:]
    flag = "--byte-level" in argv
    argv = [a for a in argv if a != "--byte-level"]
    if len(argv) != 2:
        sys.exit("usage: dummy_tokenizer.py [--byte-level] CONFIG_DIR OUT_DIR")
    main(argv[0], argv[1], flag)
