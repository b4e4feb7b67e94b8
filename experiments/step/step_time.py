"""Paired step-time measurement: the compiled train step of each policy, run in alternation.

Builds one trainer per `--variants` entry (a `--comm` value: `none` = exact, `taco`, ...) with the
same model, mesh, batch and codec flags, compiles each, then times `--steps` rounds; each round
runs one step of every variant back to back (the same random token batch), so machine load that
drifts during the measurement (other jobs on shared cores) hits every variant alike. Prints, per
variant, the median step time and tokens/s, and the median over rounds of the per-round ratio
to the first variant (`step_ratio`: > 1 is slower than the first).

Single process (simulated mesh):
  python -m experiments.step.step_time --mesh data=2,tensor=4 --steps 30
Several processes over the real transport (jax.distributed + gloo on 127.0.0.1), started by this
script (with the allocator setting of `taco-jax launch`, `--malloc keep` by default):
  python -m experiments.step.step_time --mesh data=1,tensor=2 --processes 2 ...
or one per shell:
  python -m experiments.step.step_time --mesh data=1,tensor=2 --coordinator 127.0.0.1:PORT \
      --num-processes 2 --process-id I ...
Comm fraction of the exact step over the real transport: the same flags with one process holding
both devices (in-process collectives are memory copies) gives the step without the transport.
Step times are seconds of wall clock around one jitted step (blocking on its loss).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from experiments.common import run_record


def main(argv=None) -> dict:
    # no abbreviations: _spawn passes the command line on minus --processes/--malloc/--timeout
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--mesh", default="data=2,tensor=4")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--backend", default="auto")
    p.add_argument("--algorithm", default="two_shot")
    p.add_argument("--reduce-domain", default="signal", help="two-shot taco all-reduce: signal | hadamard")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism on the tensor axis")
    p.add_argument("--transport", default="auto", choices=("auto", "xla", "gloo", "gloo_widened"),
                   help="the exact collectives' transport, as `taco-jax train --transport` (xla: XLA's own)")
    p.add_argument("--variants", default="none,taco", help="comma-separated --comm values; the first is the base")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (after 2 warm-up rounds)")
    p.add_argument("--json", default="", help="write the result here (process 0)")
    p.add_argument("--processes", type=int, default=0,
                   help="start this many local processes of one run (gloo on 127.0.0.1) and wait for them")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="with --processes: their allocator setting, as `taco-jax launch --malloc`")
    p.add_argument("--timeout", type=float, default=3600.0, help="with --processes: seconds, then they are killed")
    p.add_argument("--coordinator", default="")
    p.add_argument("--num-processes", type=int, default=0)
    p.add_argument("--process-id", type=int, default=-1)
    args = p.parse_args(argv)
    if args.processes == 1 or args.processes < 0:
        p.error(f"--processes {args.processes}: give 0 (this process only) or >= 2")
    if args.processes and (args.process_id >= 0 or args.coordinator or args.num_processes):
        p.error("--processes starts the processes itself; drop --coordinator / --num-processes / --process-id")
    if args.processes:
        from taco_jax.parallel.mesh import parse_mesh  # noqa: PLC0415

        n_mesh = 1
        for v in parse_mesh(args.mesh).values():
            n_mesh *= v
        if n_mesh % args.processes:
            p.error(f"--mesh {args.mesh} has {n_mesh} devices, not divisible by --processes {args.processes}")
    if args.processes > 1:
        return _spawn(args, sys.argv[1:] if argv is None else list(argv))

    from taco_jax.parallel.mesh import parse_mesh  # noqa: PLC0415

    run = run_record(__spec__.name, argv)
    run["command"] = os.environ.get(_COMMAND_ENV) or run["command"]  # a spawned process: what the user ran
    n = 1
    for v in parse_mesh(args.mesh).values():
        n *= v
    local = n // max(args.num_processes, 1)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={local}"
    from taco_jax.train import distributed  # noqa: PLC0415

    if args.num_processes > 1:
        distributed.initialize(distributed.DistConfig(args.coordinator, args.num_processes, args.process_id))
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from taco_jax.codec import get_kind  # noqa: PLC0415
    from taco_jax.parallel.mesh import DATA  # noqa: PLC0415
    from taco_jax.train.config import TrainConfig  # noqa: PLC0415
    from taco_jax.train.step import make_trainer  # noqa: PLC0415

    variants = args.variants.split(",")
    state = {}
    for v in variants:
        codec = {}  # the codec flags go to the variants they apply to (an exact one takes none)
        if v != "none":
            kind = get_kind(v)
            codec["algorithm"] = args.algorithm
            if kind.backends:
                codec["backend"] = args.backend
            if kind.transform_reduce:
                codec["reduce_domain"] = args.reduce_domain
        cfg = TrainConfig.from_flags(comm=v, mesh=args.mesh, model=args.model, batch_size=args.batch_size,
                                     seq_len=args.seq_len, dtype=args.dtype, vocab_size=args.vocab_size,
                                     sequence_parallel=args.sequence_parallel, transport=args.transport, **codec)
        tr = make_trainer(cfg)
        sharding = NamedSharding(tr.mesh, P(*(a for a in (DATA,) if a in tr.mesh.axis_names)))
        rng = np.random.default_rng(0)
        tok = rng.integers(0, cfg.model_config.vocab_size, (args.batch_size, args.seq_len), dtype=np.int32)
        x, y = distributed.global_arrays(sharding, tok, np.roll(tok, -1, axis=1))
        params, opt = tr.init()
        t = time.perf_counter()
        compiled = tr.train_step.lower(params, opt, x, y).compile()
        state[v] = [compiled, params, opt, x, y, time.perf_counter() - t, tr.policy]
    times = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    for r in range(args.steps + 2):
        for v in variants:
            compiled, params, opt, x, y = state[v][:5]
            t = time.perf_counter()
            params, opt, m = compiled(params, opt, x, y)
            loss = float(m["loss"])
            dt = time.perf_counter() - t
            state[v][1:3] = [params, opt]
            if r >= 2:
                times[v].append(dt)
                losses[v].append(loss)
    base = variants[0]
    tokens = args.batch_size * args.seq_len
    result = {
        "run": run,
        "command": os.environ.get(_COMMAND_ENV) or " ".join(sys.argv),
        "mesh": args.mesh, "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "dtype": args.dtype, "sequence_parallel": args.sequence_parallel,
        "reduce_domain": args.reduce_domain, "processes": jax.process_count(), "devices": len(jax.devices()),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "transport": args.transport,
        "tensor_codec": {v: f"{state[v][6].ar_fwd.name}[{state[v][6].ar_fwd.backend}]" for v in variants},
        "compile_s": {v: state[v][5] for v in variants},
        "median_step_s": {v: statistics.median(times[v]) for v in variants},
        "tokens_per_s": {v: tokens / statistics.median(times[v]) for v in variants},
        "step_ratio": {v: statistics.median(a / b for a, b in zip(times[v], times[base], strict=True))
                       for v in variants},
        "last_loss": {v: losses[v][-1] for v in variants},
        "step_s": times,
    }
    if jax.process_index() == 0:
        shown = {k: v for k, v in result.items() if k != "step_s"}
        print(json.dumps(shown, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


_COMMAND_ENV = "TACO_STEP_TIME_COMMAND"


def _spawn(args, argv: list[str]) -> dict:
    """Runs this script as `args.processes` processes of one run on 127.0.0.1 (process 0 prints and
    writes --json, or a temporary file); returns process 0's result.
    Raises RuntimeError naming the failing process (the others are stopped) or the timeout."""
    import tempfile  # noqa: PLC0415

    from experiments.common import child_env, module_command  # noqa: PLC0415
    from taco_jax.launch import free_port, malloc_env, run_local  # noqa: PLC0415

    drop = {"--processes", "--malloc", "--timeout"}
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a.split("=", 1)[0] in drop:
            continue
        rest.append(a)
    json_path = args.json
    if not json_path:  # process 0 writes its result to a temporary file, removed below
        with tempfile.NamedTemporaryFile(suffix=".json", prefix="step_time_", delete=False) as f:
            json_path = f.name
        rest += ["--json", json_path]
    env = malloc_env(child_env(), args.malloc)
    env[_COMMAND_ENV] = " ".join(["python -m experiments.step.step_time", *argv])  # what the user ran, for the result
    coord = f"127.0.0.1:{free_port()}"
    try:
        run_local([module_command("experiments.step.step_time", *rest, "--coordinator", coord,
                                  "--num-processes", str(args.processes), "--process-id", str(i))
                   for i in range(args.processes)],
                  env=env, timeout_s=args.timeout, quiet_after_first=True)
        with open(json_path) as f:
            return json.load(f)
    finally:
        if not args.json and os.path.exists(json_path):
            os.unlink(json_path)


if __name__ == "__main__":
    main()
