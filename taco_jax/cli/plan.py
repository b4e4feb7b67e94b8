"""`taco-jax plan` (compile on a simulated mesh) and `taco-jax predict` (the cost model alone)."""

from __future__ import annotations

import sys

from taco_jax.cli.common import EXIT_BAD_INPUT, EXIT_NO_FIT, HelpFormatter, error, force_cpu_devices, say
from taco_jax.cli.flags import add_flag, config_values, deprecated, train_config

NAMES = ("plan", "predict")

#: The line above `predict --paper`'s table: what its numbers are.
PAPER_NOTE = ("cost-model predictions, not measurements (taco_jax/perf/model.py: MFU 0.40, 80 % of datasheet link "
              "bandwidth, the H200-measured codec speed); range: the model's error against the emulated cluster and "
              "COCCL applied to the prediction; published: the measured speed-up the setting is checked against "
              "(docs/emulated.md)")


def _positive_int(name: str):
    """argparse type of an integer >= 1."""
    from taco_jax.train.settings import rule_error

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise rule_error(name, repr(text), "must be an integer >= 1") from None
        if value < 1:
            raise rule_error(name, str(value), "must be an integer >= 1")
        return value

    return parse


def add_parser(sub, explicit: bool = False) -> None:
    """The `plan` and `predict` subcommands: `train`'s flags that shape the run (listed; the others
    accepted, `config.PLAN_UNUSED`) plus the hardware and layout (docs/plan.md)."""
    from taco_jax.perf.hardware import load_hardware
    from taco_jax.train.config import flags

    for name, help_ in (("plan", "compile a run on a simulated mesh without allocating it: per-device memory, wire "
                                 "bytes per axis and site, TACO ops per site, predicted speedup on GPUs"),
                        ("predict", "the cost model alone (about a second): step time exact vs the policy per axis, "
                                    "speedup with its range, --min-bytes auto per site")):
        sp = sub.add_parser(name, help=help_, description=f"taco-jax {name}: {help_}.", formatter_class=HelpFormatter,
                            allow_abbrev=False, epilog="train's other flags (steps, optimization, evaluation, "
                            "checkpoints, logging) are accepted and unused, so a train --config file works as it is"
                            + ("; plan writes plan.json and plan.md to --out" if name == "plan" else "")
                            + ". docs/plan.md")
        sp.add_argument("--config", default="", metavar="FILE", help="flag values from a TOML file (as train)")
        shape = sp.add_argument_group("the run (train's flags that shape the program)")
        comm = sp.add_argument_group("communication (as train)")
        own = sp.add_argument_group(f"{name}: hardware and output")
        for flag in flags():  # a flag of plan but not predict (--out) is plan's own: predict writes nothing
            mine = "plan" in flag.applies and "predict" not in flag.applies
            group = own if mine else comm if flag.section == "communication" else shape
            add_flag(group, flag, explicit, hidden=name not in flag.applies)
        own.add_argument("--hardware", default="", metavar="NAME",
                         help=f"declared hardware (taco_jax/perf/hardware.toml: {', '.join(load_hardware())}; "
                              "or an entry of --hardware-file); empty: h200, or the file's one entry")
        own.add_argument("--hardware-file", default="", metavar="FILE",
                         help="your own cluster: a TOML file with hardware.toml's schema (docs/plan.md)")
        own.add_argument("--tp-span-nodes", type=_positive_int("tp_span_nodes"), default=None, metavar="K",
                         help="tensor-parallel groups span K nodes (TP over the inter-node link); default: "
                              "inside a node while they fit")
        own.add_argument("--layers", type=_positive_int("layers"), default=None, metavar="L",
                         help="override the model's depth (decoder layers)")
        own.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
        own.add_argument("--devices", type=_positive_int("devices"), default=None, metavar="N",
                         help="devices of the run (default: the mesh size; must equal it)"
                              + ("; plan simulates that many CPU devices" if name == "plan" else ""))
        if name == "plan":
            own.add_argument("--no-compile", action="store_true", help="the cost model only (= predict)")
            own.add_argument("--compiler", choices=("auto", "gpu", "cpu"), default="auto",
                             help="gpu: XLA:GPU compiles the step for --hardware's GPU, no GPU needed (`pip install "
                                  "-e '.[gpu-compile]'`), with a memory verdict (exit 3 when it does not fit); cpu: "
                                  "XLA:CPU on simulated devices; auto: gpu when the CUDA plugin is installed")
            own.add_argument("--extrapolate", action="store_true",
                             help="compile two shallow copies (one and two layers per stage) instead of the whole "
                                  "model and extrapolate the peak memory to its depth (minutes sooner for deep models)")
            sp.set_defaults(out="runs/plan")
        else:
            own.add_argument("--paper", action="store_true",
                             help="the model's GPU table of docs/emulated.md (the paper's settings on each TP link)")



def run(args, ctx) -> int:
    """`taco-jax plan` / `predict` (taco_jax/train/plan.py): checks every value, then prints the table;
    `plan` writes plan.json and plan.md to --out. `ctx`: `common.Context`."""
    if args.command == "predict" and args.paper:
        return _paper(args, ctx)
    compile_ = args.command == "plan" and not args.no_compile
    wins = (f"--devices {args.devices}" if args.devices else f"--mesh {args.mesh}") if ctx.own_process else ""
    try:
        n = _device_count(args)
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    compiler = "cpu"
    if compile_:
        from taco_jax.train import deviceless

        compiler, why = args.compiler, deviceless.plugin_error()
        if compiler == "auto":
            compiler = "cpu" if why else "gpu"
        if compiler == "gpu" and why:
            return error(ValueError(why), EXIT_BAD_INPUT)
        if compiler == "cpu":
            force_cpu_devices(args.mesh, wins=wins)
    from taco_jax.perf.hardware import get_hardware
    from taco_jax.train import plan as planner

    try:
        spec = get_hardware(args.hardware, args.hardware_file or None)
        cfg = planner.with_layers(train_config(args, ctx.file_policy), args.layers)
        deprecated(ctx.note)
        if compile_:
            from taco_jax.train.loop import check_out_dir

            check_out_dir(args.out)  # a file or an unwritable --out: refused before the compile
        devices = None
        if compiler == "gpu":
            if args.compiler == "auto" and spec.target is None:  # the user's entry says nothing of its GPU
                say(f"plan: hardware {spec.key!r} has no [{spec.key}.target] table: compiling with XLA:CPU")
                force_cpu_devices(args.mesh, wins=wins)
            else:
                devices = deviceless.gpu_devices(spec, n)
        extrapolate = args.command == "plan" and args.extrapolate
        if extrapolate and devices is None:  # XLA:CPU's peak is no GPU's: nothing to extrapolate for
            raise ValueError("--extrapolate extrapolates XLA:GPU's peak: it needs --compiler gpu (the CUDA plugin and "
                             "a [KEY.target] table), and a compile (not --no-compile)")
        if extrapolate and args.layers is not None:
            raise ValueError(f"--extrapolate compiles shallow copies of the model's own depth; leave out --layers "
                             f"{args.layers}")
        if devices is not None:
            say(f"plan: XLA:GPU compiles for {spec.hardware.name} on {n} abstract devices (no GPU needed); the CUDA "
                 "plugin's lines \"Could not find cuda drivers on your machine, GPU will not be used\" say just that")
        result = planner.plan(cfg, spec, tp_span_nodes=args.tp_span_nodes, compile=compile_, say=say,
                              devices=devices, extrapolate=extrapolate)
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    return _report(args, result, spec)


def _device_count(args) -> int:
    """The devices of `--mesh`. Raises ValueError naming a malformed mesh, or a `--devices` that
    differs from its size."""
    from taco_jax.parallel.mesh import parse_mesh

    n = 1
    for v in parse_mesh(args.mesh).values():
        n *= v
    if args.devices is not None and args.devices != n:
        raise ValueError(f"devices={args.devices} differs from the mesh {args.mesh!r} ({n} devices); give the mesh's "
                         "size")
    return n


def _report(args, result: dict, spec) -> int:
    """Prints the plan (`--json`: as JSON), writes plan.json and plan.md (`plan`); the exit status:
    `EXIT_NO_FIT` when XLA:GPU's memory verdict says the step does not fit `spec`'s GPU."""
    import pathlib

    from taco_jax.train import plan_report as report
    from taco_jax.util import jsonio

    if args.command == "plan":
        out = pathlib.Path(args.out)
        if (out / "plan.json").exists() or (out / "plan.md").exists():
            say(f"plan: replacing the previous plan in {out} (give another --out to keep it)")
        out.mkdir(parents=True, exist_ok=True)
        jsonio.write(out / "plan.json", result)
        (out / "plan.md").write_text(report.markdown(result))
    if args.json:
        print(jsonio.dumps(result, indent=2))
    else:
        print("\n".join(report.lines(result)))
        if args.command == "plan":
            print(f"written: {pathlib.Path(args.out) / 'plan.json'}, {pathlib.Path(args.out) / 'plan.md'}")
    verdict = result.get("compiled", {}).get("verdict")
    if verdict and verdict["fits"] is False:
        say(f"plan: the step does not fit the {spec.hardware.name}'s memory (exit {EXIT_NO_FIT})")
        return EXIT_NO_FIT
    return 0


def _paper(args, ctx) -> int:
    """`predict --paper`: the model's GPU table at the paper's fixed settings (refused with another
    flag, which it would ignore)."""
    import json

    from taco_jax.train import plan as planner
    from taco_jax.train import plan_report as report

    refused = _paper_refusal(args, ctx)
    if refused:
        return error(ValueError(refused), EXIT_BAD_INPUT)
    try:
        rows = planner.paper_table()
    except ValueError as e:
        return error(e, EXIT_BAD_INPUT)
    print(json.dumps(rows, indent=2) if args.json else "\n".join([PAPER_NOTE, *report.paper_lines(rows)]))
    return 0


def _paper_refusal(args, ctx) -> str:
    """Why `predict --paper` (whose settings are fixed) refuses this command line: the other flags it
    was given, typed or set by `--config`; "" when none."""
    typed = {a.split("=", 1)[0] for a in (sys.argv[1:] if ctx.argv is None else ctx.argv) if a.startswith("--")}
    given = sorted(typed - {"--paper", "--json", "--config"})
    if args.config:  # the file's own settings, named as their flags (a file holding only paper = true is fine)
        values, policy = config_values(ctx.parser.flag_parsers["predict"], args.config, [])
        first = ("--mesh", "--model", "--comm", "--hardware", "--hardware-file", "policy")  # named first
        keys = sorted({"--" + k.replace("_", "-") for k in values} - {"--paper", "--json"}
                      | ({"policy"} if policy is not None else set()),
                      key=lambda k: (first.index(k) if k in first else len(first), k))
        if keys:
            given.append(f"--config {args.config!r} setting {', '.join(keys[:6])}"
                         + (f" and {len(keys) - 6} more" if len(keys) > 6 else ""))
    if not given:
        return ""
    source = "" if "--paper" in typed else f"--config {args.config!r} sets paper = true: "
    return (f"{source}predict --paper prints the paper's fixed settings and takes no other flag (got "
            f"{', '.join(given)}); leave out --paper to predict your own run")
