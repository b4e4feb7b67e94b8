"""Fingerprint of a training configuration: compiled train-step HLO (metadata stripped), two steps' losses, wire bytes.

For checking that a refactor leaves the compiled program and its numbers bit-identical: run it
in two checkouts with the same `taco-jax train` flags and diff the outputs.

  python -m experiments.step.hlo_dump OUT_DIR -- --model gpt2-tiny --mesh data=2,tensor=2 --comm taco

Writes OUT_DIR/step.hlo (the optimized HLO of `jit(train_step).lower(...).compile().as_text()`
with `metadata={...}` attributes removed) and OUT_DIR/numbers.json (the two steps' losses and
gradient norms as hex floats, and the wire bytes per step by mesh axis). The batches are random
tokens from a fixed seed, so no dataset is read.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

_METADATA = re.compile(r",?\s*metadata=\{[^{}]*\}")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def strip_metadata(hlo: str) -> str:
    """`hlo` without its metadata: the `metadata={...}` attributes (op names, source lines) and the
    module header's tables of source files, functions and stack frames."""
    out, skip = [], False
    for line in hlo.split("\n"):
        if line in _TABLES:
            skip = True
        elif skip and not line[:1].isdigit() and line.strip():  # table rows start with their number
            skip = False
        if not skip and line.strip():
            out.append(line)
    return _METADATA.sub("", "\n".join(out)) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m experiments.step.hlo_dump OUT_DIR -- TRAIN_FLAGS..."
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if len(argv) < 1 or (len(argv) > 1 and argv[1] != "--") or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    out = pathlib.Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    from taco_jax import cli
    from taco_jax.cli.common import force_cpu_devices
    from taco_jax.cli.flags import train_config

    args = cli._parser().parse_args(["train", *argv[2:]])
    force_cpu_devices(args.mesh)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from taco_jax.collectives.hlo import collective_bytes
    from taco_jax.train.step import make_trainer

    cfg = train_config(args, None)  # the flags' TrainConfig, as `taco-jax train` builds it
    trainer = make_trainer(cfg)
    params, opt_state = trainer.init()
    axes = tuple(a for a in ("data",) if a in trainer.mesh.axis_names)
    sharding = NamedSharding(trainer.mesh, P(*axes))
    spec = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), np.int32, sharding=sharding)
    compiled = trainer.train_step.lower(params, opt_state, spec, spec).compile()
    hlo = compiled.as_text()
    (out / "step.hlo").write_text(strip_metadata(hlo))
    rng = np.random.default_rng(0)
    vocab = min(cfg.model.vocab_size, cfg.model_config.vocab_size)
    numbers = {"wire_bytes": collective_bytes(hlo, trainer.mesh), "steps": []}
    for _ in range(2):
        shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
        tok = jax.device_put(rng.integers(0, vocab, shape, dtype=np.int32)[:, :-1], sharding)
        params, opt_state, metrics = compiled(params, opt_state, tok, tok)
        numbers["steps"].append({k: float(np.asarray(v, np.float64)).hex() for k, v in metrics.items()
                                 if np.ndim(v) == 0})
    (out / "numbers.json").write_text(json.dumps(numbers, indent=1, sort_keys=True, default=str) + "\n")
    print(json.dumps(numbers["steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
