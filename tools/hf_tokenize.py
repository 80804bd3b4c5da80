#!/usr/bin/env python3
"""Tokenize text files with a Hugging Face tokenizer.json, for prepare_data --tokenizer.

    hf_tokenize.py TOKENIZER_JSON OUT_BIN [--eos TOKEN] FILE...

Each FILE is one document. Writes every document's ids, each document preceded by the EOS
token (the separator llm.c's shards use), to OUT_BIN as raw little-endian uint32, and prints
one JSON line: vocab_size, eos_id, eos_token, tokens, bytes, seconds, and eos_inside (the
documents whose own text encodes to the EOS token, e.g. a literal "<|endoftext|>": with
document masking each such occurrence would begin a false document) with the first of them.

Tokenization is Hugging Face's `tokenizers` library (its Rust BPE, its Unicode pre-tokenizer
regex), so ids are exactly what transformers' tokenizer gives. Documents are encoded whole,
never cut, so byte-level BPE (GPT-2, LLaMA-3, Qwen) and sentencepiece-style BPE (LLaMA-2's
Metaspace "prepend a space" rule) both come out exact; encode_batch spreads documents over
the cores. The EOS token is --eos, else tokenizer_config.json's eos_token beside the file, else
the first of the usual names present in the vocabulary.
"""
import argparse
import array
import json
import os
import sys
import time

USUAL_EOS = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"]
BATCH_BYTES = 64 << 20  # documents are read and encoded this many bytes at a time


def fail(message):
    print(f"hf_tokenize: {message}", file=sys.stderr)
    sys.exit(2)


def find_eos(tokenizer, tokenizer_path, requested):
    if requested:
        if tokenizer.token_to_id(requested) is None:
            fail(f"--eos {requested!r} is not a token of {tokenizer_path}")
        return requested
    config = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), "tokenizer_config.json")
    if os.path.exists(config):
        try:
            with open(config, encoding="utf-8") as f:
                settings = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            fail(f"{config}: not a readable tokenizer_config.json: {e}")
        if not isinstance(settings, dict):
            fail(f"{config}: not a tokenizer_config.json (a JSON object expected)")
        eos = settings.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            if tokenizer.token_to_id(eos) is None:
                fail(f"{config}: eos_token {eos!r} is not a token of {tokenizer_path} "
                     "(name one with --eos)")
            return eos
    for name in USUAL_EOS:
        if tokenizer.token_to_id(name) is not None:
            return name
    fail(f"{tokenizer_path}: no end-of-text token found ({', '.join(USUAL_EOS)}); pass --eos TOKEN")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer")
    parser.add_argument("out")
    parser.add_argument("--eos", default="")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("the Python package 'tokenizers' is missing (scripts/install_deps.sh installs it)")
    try:
        tokenizer = Tokenizer.from_file(args.tokenizer)
    except Exception as e:  # the library raises its own exception types
        fail(f"{args.tokenizer}: not a Hugging Face tokenizer.json: {e}")
    eos = find_eos(tokenizer, args.tokenizer, args.eos)
    eos_id = tokenizer.token_to_id(eos)

    start, total_tokens, total_bytes = time.time(), 0, 0
    eos_inside, eos_inside_first = 0, ""
    try:
        with open(args.out, "wb") as out:
            batch, paths, batch_bytes = [], [], 0

            def flush():
                nonlocal total_tokens, eos_inside, eos_inside_first
                for path, encoding in zip(paths, tokenizer.encode_batch(batch, add_special_tokens=False)):
                    if eos_id in encoding.ids:
                        eos_inside += 1
                        eos_inside_first = eos_inside_first or path
                    ids = array.array("I", [eos_id])
                    ids.extend(encoding.ids)
                    if sys.byteorder != "little":
                        ids.byteswap()
                    out.write(ids.tobytes())
                    total_tokens += len(ids)
                batch.clear()
                paths.clear()

            for path in args.files:
                try:
                    with open(path, "rb") as f:
                        raw = f.read()
                except OSError as e:
                    fail(f"{path}: cannot read: {e.strerror}")
                total_bytes += len(raw)
                batch.append(raw.decode("utf-8", errors="replace"))
                paths.append(path)
                batch_bytes += len(raw)
                if batch_bytes >= BATCH_BYTES:
                    flush()
                    batch_bytes = 0
            if batch:
                flush()
    except OSError as e:  # a full disk: one line naming the file, not a traceback
        fail(f"{args.out}: cannot write: {e.strerror or e}")
    print(json.dumps({"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
                      "eos_id": eos_id, "eos_token": eos, "tokens": total_tokens,
                      "bytes": total_bytes, "seconds": round(time.time() - start, 3),
                      "eos_inside": eos_inside, "eos_inside_first": eos_inside_first}))


if __name__ == "__main__":
    main()
