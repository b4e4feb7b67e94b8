"""What a run prints: progress from process 0 only, warnings and errors from every process, each line
written whole (one `write` per line, then flush) so the lines of several processes never interleave
mid-line, and the short summary block shown at the end of `taco-jax train` / `compare`."""

from __future__ import annotations

import pathlib
import sys


def _process() -> int:
    import jax

    return jax.process_index()


def say(msg: str) -> None:
    """Progress / information for the run: written to stderr by process 0 only."""
    if _process() == 0:
        write_line(msg)


def warn(msg: str) -> None:
    """A warning: written to stderr by every process (process i > 0 names itself)."""
    p = _process()
    write_line(msg if p == 0 else f"(process {p}) {msg}")


def write_line(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # one write: a line of another process cannot land inside it
    sys.stderr.flush()


def rel(path, run_dir) -> str:
    """`path` relative to the run folder `run_dir` when it lies inside it, else as given."""
    path, run_dir = pathlib.Path(path).absolute(), pathlib.Path(run_dir).absolute()
    return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)


#: Keys of a `train` summary shown by `summary_block` (label, key); the rest stays in summary.json.
TRAIN_KEYS = (("comm", "comm"), ("mesh", "mesh"), ("steps", "steps"), ("train loss", "final_train_loss"),
              ("val loss", "final_val_loss"), ("throughput", "tokens_per_s"),
              ("step throughput", "step_tokens_per_s"), ("compile time", "compile_s"),
              ("wire bytes/step", "wire_bytes_per_step"), ("resumed from step", "resumed_from_step"),
              ("preempted at step", "preempted_at_step"))
#: The same for a `compare` summary.
COMPARE_KEYS = (("mesh", "mesh"), ("steps", "steps"), ("taco run codecs", "codecs_taco"),
                ("val loss none", "val_loss_none"),
                ("val loss taco", "val_loss_taco"), ("relative diff", "val_loss_rel_diff"),
                ("wire bytes/step", "wire_bytes_per_step"), ("wire ratio compiled", "wire_ratio_taco_over_none"),
                ("wire ratio issued", "tensor_wire_ratio_vs_exact_issued"), ("throughput", "tokens_per_s"),
                ("step throughput", "step_tokens_per_s"))


def format_bytes(n) -> str:
    """A byte count in decimal units, two decimals: 512 B, 472.62 KB, 1.20 MB, 2.05 GB."""
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:,.2f} {unit}"
    return f"{int(n)} B"


#: The unit of a shown number (summary key -> how one value is written).
def _tokens_per_s(v) -> str:
    return f"{v:,.1f} tokens/s" if v < 1000 else f"{v:,.0f} tokens/s"


UNITS = {"tokens_per_s": _tokens_per_s, "step_tokens_per_s": _tokens_per_s,
         "compile_s": lambda v: f"{v:,.1f} s", "wire_bytes_per_step": format_bytes,
         "val_loss_rel_diff": lambda v: f"{100 * v:+.3f} %",
         "wire_ratio_taco_over_none": lambda v: f"{v:.3f}", "tensor_wire_ratio_vs_exact_issued": lambda v: f"{v:.3f}"}
#: What a shown number is measured against (summary key -> note after it; `{dtype}`: the summary's).
NOTES = {"wire_ratio_taco_over_none": "(taco / exact bytes per step as compiled; XLA:CPU widens the exact "
                                      "step's bf16 all-reduces to f32)",
         "tensor_wire_ratio_vs_exact_issued": "(tensor axis: taco / the exact step's {dtype} messages as issued)",
         "val_loss_rel_diff": "((taco - none) / none)",
         "wire_bytes_per_step": "(sent per device, by mesh axis, as compiled; exact bytes: summary.json)",
         "final_train_loss": "(mean of the last {final_train_loss_steps} steps' losses; each step's: metrics.jsonl)",
         "tokens_per_s": "(over the run's wall time after compiling: evaluation and checkpoints included; "
                         "per step: metrics.jsonl)",
         "step_tokens_per_s": "(median training step after the first: no evaluation, checkpoint or warmup)"}


def summary_block(summary: dict, out_dir) -> str:
    """A few lines of a run's key numbers (`train` or `compare` summary), ending with where the full
    summary is: `<out_dir>/summary.json`."""
    keys = COMPARE_KEYS if "val_loss_taco" in summary else TRAIN_KEYS
    lines = []
    for label, key in keys:
        if summary.get(key) is not None:
            note = " " + NOTES[key].format_map({"final_train_loss_steps": 10, **summary}) if key in NOTES else ""
            lines.append(f"  {label + ':':<20} {_fmt(summary[key], UNITS.get(key))}{note}")
    return "\n".join(["summary", *lines, f"  {'full summary:':<20} {pathlib.Path(out_dir) / 'summary.json'}"])


def _fmt(v, unit=None) -> str:
    """`v` as shown: `unit(v)` for a number with a unit, floats to 5 significant digits, a dict as
    "key value, ...", a dict of dicts as "key: key value, ...; key: ..."."""
    if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
        return "; ".join(f"{k}: {_fmt(x, unit)}" for k, x in v.items())
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x, unit)}" for k, x in v.items()) or "-"
    if unit is not None and isinstance(v, int | float):
        return unit(v)
    if isinstance(v, float):
        return f"{v:.5g}"
    return str(v)
