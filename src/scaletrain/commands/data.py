"""``scaletrain data prepare``: tokenize a text corpus once into a memory-mapped token file."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "data"
HELP = "prepare your text once: tokenize it into a memory-mapped token file that training streams"
DESCRIPTION = """Tokenize a .txt/.jsonl file, directory or glob with a local Hugging Face tokenizer (or bytes)
into OUT/tokens.bin (uint16, or uint32 past 65,536 tokens) and OUT/meta.json. Train on it without
loading it: data.name=tokens:OUT (or text:OUT).

  scaletrain data prepare corpus/ --tokenizer my_tokenizer/ --out corpus_tokens
  scaletrain train data.name=tokens:corpus_tokens model.name=hf:llama"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = sub.add_parser("prepare", help="tokenize text into OUT/tokens.bin + OUT/meta.json")
    q.add_argument("source", help="a .txt or .jsonl file, a directory of them, or a glob (quote it)")
    q.add_argument("--out", required=True, help="new directory for tokens.bin and meta.json")
    q.add_argument("--tokenizer", default="", help="a local Hugging Face tokenizer directory (tokenizer.json); "
                                                   "default: bytes (vocabulary 256)")
    q.add_argument("--field", default="text", help="the JSON key holding the text in .jsonl files (default: text)")
    q.add_argument("--json", action="store_true", help="print the meta as one JSON object")
    q.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="the progress line on stderr: auto = only on a terminal")


def run(args: argparse.Namespace) -> int:
    from scaletrain.data.prepare import prepare

    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    meta = prepare(args.source, args.out, args.tokenizer, args.field, progress=sys.stderr if show else None)
    if args.json:
        print(json.dumps(meta))
    else:
        print(f"wrote {args.out}: {meta['num_tokens']:,} {meta['dtype']} tokens from {meta['documents']:,} "
              f"documents ({meta['source_bytes']:,} bytes), vocabulary {meta['vocab_size']:,} "
              f"({meta['tokenizer']}); train with data.name=tokens:{args.out}")
    return 0
