#!/usr/bin/env python3
"""Train a small byte-level BPE tokenizer (GPT-2's scheme) with Hugging Face's tokenizers.

    train_bpe.py --out tokenizer.json [--vocab-size N] [--extra-special N] FILE...

For tests and demos that must not download a tokenizer: trains on local text (the licence
texts every Debian system ships will do) and writes a tokenizer.json that prepare_data
--tokenizer reads like any Hugging Face one. <|endoftext|> is the end-of-text token. With
--extra-special N, N placeholder special tokens come before it, so the vocabulary passes
65,536 the way Qwen's and LLaMA-3's do and prepare_data must write uint32 shards.
"""
import argparse
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from write_whole import write_whole


def fail(message):
    """Bad input: one line naming it, exit status 2."""
    print(f"train_bpe: {message}", file=sys.stderr)
    sys.exit(2)


def write_new(path, text):
    """path holds text, renamed into place once whole; a failed write is one line."""
    try:
        write_whole(path, text)
    except OSError as e:
        fail(f"{path}: {e.strerror or e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--extra-special", type=int, default=0)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    for f in args.files:
        if not os.path.isfile(f) or not os.access(f, os.R_OK):
            fail(f"{f}: not a readable file")
    if args.vocab_size < 257:
        fail(f"--vocab-size {args.vocab_size}: at least 257 (the 256 bytes and <|endoftext|>)")
    if args.extra_special < 0:
        fail(f"--extra-special {args.extra_special}: 0 or more")
    # Both files are new: a tokenizer (or a model's tokenizer_config.json) already there is kept.
    config = os.path.join(os.path.dirname(os.path.abspath(args.out)), "tokenizer_config.json")
    for path in (args.out, config):
        if os.path.exists(path):
            fail(f"{path} exists; give --out a new directory")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(args.files, trainer)
    if args.extra_special:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(args.extra_special)])
    tokenizer.add_special_tokens(["<|endoftext|>"])
    write_new(args.out, tokenizer.to_str(pretty=True))
    write_new(config, json.dumps({"eos_token": "<|endoftext|>"}))
    print(json.dumps({"out": args.out, "vocab_size": tokenizer.get_vocab_size()}))


if __name__ == "__main__":
    main()
