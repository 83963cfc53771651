"""Train the byte-level BPE tokenizer shipped with hp-trainer on the synthetic corpus.

Needs the ``tokenizers`` package (``pip install 'hp-trainer[tokenizers]'``); runs offline.

Run from the repository root after ``make_corpus.py``::

    .venv/bin/python packages/hp-trainer/scripts/make_tokenizer.py
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"


def main() -> None:
    """Train a 2048-entry byte-level BPE vocabulary and write ``tokenizer.json``."""
    assets = Path(__file__).resolve().parent.parent / "src" / "hp_trainer" / "assets"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", type=Path, default=assets / "tiny_stories_synth.txt.gz")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=assets / "tokenizer.json")
    args = parser.parse_args()
    with gzip.open(args.corpus, "rt") as f:
        docs = [line.rstrip("\n") for line in f if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(args.out))
    # the special tokens, where HF tokenizer folders name them (hp-trainer reads BOS/EOS here)
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (args.out.parent / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
