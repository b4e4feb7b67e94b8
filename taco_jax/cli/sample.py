"""`taco-jax sample`: generate text from a run folder or a Hugging Face checkpoint."""

from __future__ import annotations

import math

from taco_jax.cli.common import EXIT_BAD_INPUT, HelpFormatter, error

NAMES = ("sample",)


def add_parser(sub, explicit: bool = False) -> None:
    """The `sample` subcommand (`explicit` is unused: no flag of it is a setting)."""
    sa = sub.add_parser("sample", formatter_class=HelpFormatter,
                        help="generate text from a run folder or an HF checkpoint")
    sa.add_argument("--from", dest="source", required=True, metavar="RUN_DIR|HF_DIR",
                    help="a run's --out folder (its --export-hf, else its latest checkpoint) or an HF checkpoint")
    sa.add_argument("--prompt", required=True, help="text to continue (encoded with the run's own tokenizer)")
    sa.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample from softmax(logits / T)")
    sa.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    sa.add_argument("--seed", type=int, default=0, help="random seed of the samples")


def run(args, ctx) -> int:
    """Prints the text; returns the exit status."""
    from taco_jax.train.sample import sample

    try:
        for flag, v in (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k)):
            if v < 0:
                raise ValueError(f"{flag} {v} must be an integer >= 0")
        if not (args.temperature >= 0 and math.isfinite(args.temperature)):
            raise ValueError(f"--temperature {args.temperature} must be a finite number >= 0")
        if not 0 <= args.seed < 2**63:
            raise ValueError(f"--seed {args.seed} must be in [0, 2**63) (JAX's seeds)")
        print(sample(args.source, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                     seed=args.seed))
        return 0
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)

