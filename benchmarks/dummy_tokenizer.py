"""A model directory for serving benchmarks with dummy weights: the config of a real model plus a synthetic
word-level tokenizer with one distinct piece per id ("t0", "t1", ...), so that the gateway can stream text for
random token ids without the model's real tokenizer (no model hub here).

  python benchmarks/dummy_tokenizer.py benchmarks/configs/qwen3-0.6b /tmp/qwen3-0.6b-dummy
  kvgate serve --model /tmp/qwen3-0.6b-dummy --load-format dummy
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main(config_dir: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(config_dir, "config.json"), out_dir)
    with open(os.path.join(config_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins pieces with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out_dir)
    print(f"wrote {out_dir} (vocab {vocab_size})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
