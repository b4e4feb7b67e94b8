"""`taco-jax` command line: `train` (one run) and `compare` (--comm none vs taco, same seed and data)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys


def _field_help(cls) -> dict[str, str]:
    """`name -> comment` from the `name: type = default  # comment` lines of a dataclass's source
    (the comments are the fields' documentation; simple_parsing reads help the same way)."""
    src = inspect.getsource(cls)
    line = re.compile(r"^\s+(\w+): [^=\n]+=[^#\n]*#\s*(.+)$", flags=re.M)
    return {m[1]: m[2].strip().replace("%", "%%") for m in line.finditer(src)}  # argparse %-formats help


def _parser() -> argparse.ArgumentParser:
    from taco_jax.train.config import TrainConfig  # no jax import at module level

    p = argparse.ArgumentParser(prog="taco-jax", description=__doc__)
    helps = _field_help(TrainConfig)
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "train one model"), ("compare", "train with --comm none and taco; plot both")):
        sp = sub.add_parser(name, help=help_, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        for f in dataclasses.fields(TrainConfig):
            if name == "compare" and f.name == "comm":
                continue
            flag = "--" + f.name.replace("_", "-")
            flags = (flag, "--policy") if f.name == "policy_file" else (flag,)  # `train --policy FILE`
            if f.type in ("bool", bool):
                sp.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                                help=helps.get(f.name, ""))
            else:
                sp.add_argument(*flags, type=type(f.default), default=f.default, help=helps.get(f.name, ""))
        sp.add_argument("--no-progress", action="store_true", help="hide the progress bar")
        sp.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() (multi-host)")
    cal = sub.add_parser("calibrate", help="choose a codec per TP site from captured messages (train --capture N)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cal.add_argument("--captures", required=True, help="<run>/captures folder written by `train --capture N`")
    cal.add_argument("--out", default="policy.json", help="policy file to write (for `train --policy FILE`)")
    cal.add_argument("--budget", type=float, default=1.0625, help="max wire bytes per element of a chosen codec")
    cal.add_argument("--max-messages", type=int, default=16, help="messages per site in each split")
    cal.add_argument("--kinds", nargs="+", default=None, help="restrict the candidates to these codec kinds")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "calibrate":  # one host device; no mesh
        from taco_jax.train.calibrate import main_args

        try:
            print(json.dumps(main_args(args.captures, args.out, args.budget, args.max_messages, args.kinds), indent=2))
        except ValueError as e:
            print(f"taco-jax: error: {e}", file=sys.stderr)
            return 2
        return 0
    from taco_jax.parallel.mesh import parse_mesh
    from taco_jax.train.config import TrainConfig

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    try:
        cfg = TrainConfig(**kwargs)  # validates everything before jax is even imported
    except ValueError as e:
        print(f"taco-jax: error: {e}", file=sys.stderr)
        return 2
    # A simulated CPU mesh needs its device count fixed before jax is imported; harmless on GPU.
    n = 1
    for v in parse_mesh(cfg.mesh).values():
        n *= v
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    if args.distributed:
        jax.distributed.initialize()
    from taco_jax.train.loop import compare, train

    try:
        result = train(cfg, progress=not args.no_progress) if args.command == "train" else \
            compare(cfg, progress=not args.no_progress)
    except (ValueError, FloatingPointError) as e:  # FloatingPointError: a codec with nonfinite="error"
        print(f"taco-jax: error: {e}", file=sys.stderr)
        return 2
    shown = {k: v for k, v in result.items() if k not in ("wire_detail", "config")}
    print(json.dumps(shown, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
