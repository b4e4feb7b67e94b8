"""`taco-jax prepare-data`: a text / JSONL corpus as token files for `train --data`."""

from __future__ import annotations

from taco_jax.cli.common import EXIT_BAD_INPUT, HelpFormatter, error

NAMES = ("prepare-data",)


def add_parser(sub, explicit: bool = False) -> None:
    """The `prepare-data` subcommand (`explicit` is unused: no flag of it is a setting)."""
    pd = sub.add_parser("prepare-data", formatter_class=HelpFormatter,
                        help="tokenize text / JSONL files into train.bin, val.bin, meta.json (for train --data)")
    pd.add_argument("inputs", nargs="+", help="text files, folders of them (.txt/.md/.text/.jsonl), JSONL files")
    pd.add_argument("--out", required=True, help="folder to write (train.bin, val.bin, tokenizer.json, meta.json)")
    pd.add_argument("--tokenizer", default="", help="a tokenizers JSON file (an HF tokenizer.json) to encode with")
    pd.add_argument("--init-from", default="", help="HF checkpoint folder whose tokenizer.json to encode with")
    pd.add_argument("--vocab-size", type=int, default=0,
                    help="without --tokenizer / --init-from: train a byte-level BPE of this size (0: 2048)")
    pd.add_argument("--text-field", default="text", help="JSONL: the field holding each document's text")
    pd.add_argument("--val-fraction", type=float, default=0.1, help="last fraction of the token stream held out")
    pd.add_argument("--eot-token", default="<|endoftext|>", help="token appended after every document")
    pd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args, ctx) -> int:
    """Prints meta.json's summary; returns the exit status."""
    import json

    from taco_jax.data import prepare_data

    try:
        meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, init_from=args.init_from,
                            vocab_size=args.vocab_size, text_field=args.text_field,
                            val_fraction=args.val_fraction, eot_token=args.eot_token,
                            progress=not args.no_progress)
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    print(json.dumps({k: v for k, v in meta.items() if k != "sources"} | {"sources": len(meta["sources"])},
                     indent=2))
    return 0
