"""`taco-jax calibrate`: a codec per TP site from captured messages (train/calibrate.py)."""

from __future__ import annotations

from taco_jax.cli.common import EXIT_BAD_INPUT, HelpFormatter, error

NAMES = ("calibrate",)


def add_parser(sub, explicit: bool = False) -> None:
    """The `calibrate` subcommand (`explicit` is unused: no flag of it is a setting)."""
    from taco_jax.train.calibrate import DEFAULT_BUDGET

    cal = sub.add_parser("calibrate", help="choose a codec per TP site from captured messages (train --capture N)",
                         formatter_class=HelpFormatter, allow_abbrev=False)
    cal.add_argument("--captures", required=True, help="<run>/captures folder written by `train --capture N`")
    cal.add_argument("--out", default="policy.json", help="policy file to write (for `train --policy FILE`)")
    cal.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                     help="max wire bytes per element of a chosen codec (= TACO's E4M3 G=128 dual codec)")
    cal.add_argument("--max-messages", type=int, default=16,
                     help="messages per site in each split (0: all of them; memory and time grow with it)")
    cal.add_argument("--kinds", nargs="+", default=None, help="restrict the candidates to these codec kinds")


def run(args, ctx) -> int:
    """Prints the chosen policy as JSON; returns the exit status."""
    from taco_jax.train.calibrate import main_args
    from taco_jax.util import jsonio

    try:
        if args.max_messages < 0:  # named as the flag (calibrate() names its keyword)
            raise ValueError(f"--max-messages {args.max_messages} must be >= 0 (messages per site in each split; "
                             "0: all of them)")
        if not args.budget > 0:
            raise ValueError(f"--budget {args.budget:g} must be > 0 (wire bytes per element)")
        result = main_args(args.captures, args.out, args.budget, args.max_messages, args.kinds)
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    print(jsonio.dumps(result, indent=2))
    return 0
