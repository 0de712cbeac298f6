"""The ``attnres-dist prepare-data`` subcommand: arguments, then ``prepare_dataset``.

attnres-dist prepare-data notes/*.txt dump.jsonl --output data/mycorpus
attnres-dist prepare-data dump.jsonl --output data/c --tokenizer hf --tokenizer-path tok.json
"""

from __future__ import annotations

import argparse

from attnres_dist.data.tokenizer import TOKENIZER_KINDS, build_tokenizer


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``prepare-data`` on an ``add_subparsers()`` object; returns its parser."""
    parser = subparsers.add_parser(
        "prepare-data",
        help="tokenize text/JSONL files into a train/valid dataset",
        description=(
            "Tokenize documents into PREFIX_train/PREFIX_valid Megatron indexed datasets plus "
            "PREFIX.meta.json. A .jsonl file holds one document per line; any other file is "
            "one document."
        ),
    )
    parser.add_argument("inputs", nargs="+", help="text files and/or .jsonl files")
    parser.add_argument("--output", required=True, metavar="PREFIX", help="dataset prefix")
    parser.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="bytes")
    parser.add_argument(
        "--tokenizer-path", default=None, help="tokenizer.json (for --tokenizer hf)"
    )
    parser.add_argument("--text-key", default="text", help="JSON field holding the text")
    parser.add_argument(
        "--valid-fraction", type=float, default=0.02, help="share of documents for validation"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/valid split")
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    # Imported here so that building the CLI parser does not import megatron-core.
    from attnres_dist.data.indexed import read_metadata
    from attnres_dist.data.prepare import prepare_dataset

    tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_path)
    prefix = prepare_dataset(
        args.inputs,
        args.output,
        tokenizer,
        text_key=args.text_key,
        valid_fraction=args.valid_fraction,
        seed=args.seed,
    )
    meta = read_metadata(prefix)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['docs']:,} documents, {info['tokens']:,} tokens")
    print(
        f"wrote {prefix} ({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}); "
        f"train with data.path={prefix}"
    )
    return 0
