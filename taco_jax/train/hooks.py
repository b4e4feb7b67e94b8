"""Per-step hooks of the training loop (`train/loop.py`): each concern beside the step itself is one
small object of the same shape, as Flax/CLU's periodic actions.

A hook may implement any of four methods. The hooks form layers around the step, the first of the
list outermost: `before_step` runs in list order, `on_step` in reverse (the watchdog sees the
step's result first, the checkpoint last).
  `before_step(state, step) -> dict | None`  before the train step (it donates the parameters):
                                             entries for the step's metrics record;
  `on_step(state, step, rec)`                after it, with the step's record (`rec`, mutable);
  `end(state) -> dict | None`                the loop ended (last step or preemption): finish
                                             pending work; entries for the run's summary;
  `close()`                                  always, however the loop ended (errors included).
A hook stops the run by raising (the error reaches the caller) or by setting `state.preempted`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import signal
import sys
import threading
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from taco_jax.codec import raise_if_nonfinite
from taco_jax.collectives.policy import SITES
from taco_jax.util import jsonio
from taco_jax.util.console import rel, say


@dataclasses.dataclass
class RunState:
    """What changes during a run: the parameters and optimizer state (replaced every step), the batch
    the next step trains on, the metrics records so far (`history`; a resumed run's earlier ones
    first), the latest validation loss, and the step a preemption stopped the run at (None)."""

    params: object
    opt_state: object
    inputs: jax.Array
    targets: jax.Array
    start: int = 0  # the step the run starts after (a resumed run: its checkpoint's step)
    history: list = dataclasses.field(default_factory=list)
    val_loss: float | None = None
    preempted: int | None = None
    resume_notes: list = dataclasses.field(default_factory=list)  # what differs from the checkpointed run's config


class Hook:
    """Base of the loop's hooks: every method does nothing (see the module docstring)."""

    def before_step(self, state: RunState, step: int) -> dict | None:
        return None

    def on_step(self, state: RunState, step: int, rec: dict) -> None:
        pass

    def end(self, state: RunState) -> dict | None:
        return None

    def close(self) -> None:
        pass


class Hooks(contextlib.AbstractContextManager):
    """An ordered list of hooks (module docstring); `with hooks:` closes all of them, innermost first,
    each even when another's close raised. `guard`: `distributed.StepWatchdog.guard` (the export)."""

    def __init__(self, hooks, guard=None):
        self.hooks = [h for h in hooks if h is not None]
        self.guard = guard or _no_guard

    def before_step(self, state, step) -> dict:
        extra = {}
        for h in self.hooks:
            extra.update(h.before_step(state, step) or {})
        return extra

    def on_step(self, state, step, rec) -> None:
        for h in reversed(self.hooks):
            h.on_step(state, step, rec)

    def end(self, state) -> dict:
        out = {}
        for h in self.hooks:
            out.update(h.end(state) or {})
        return out

    def __exit__(self, *exc):
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.callback(h.close)
        return None


@contextlib.contextmanager
def _no_guard(what: str, step: int, *, kind: str, **_):
    yield


class Watchdog(Hook):
    """`--step-timeout S`: `distributed.StepWatchdog` armed around each step (the innermost hook, so
    the other hooks' work is not counted in the step)."""

    def __init__(self, watchdog):
        self.watchdog = watchdog

    def before_step(self, state, step):
        self.watchdog.start(step)

    def on_step(self, state, step, rec):
        self.watchdog.done()

    def end(self, state):
        return {"step_timeout_auto": self.watchdog.describe()} if self.watchdog.auto else None

    def close(self):
        self.watchdog.close()


class Capture(Hook):
    """`--capture N`: the TP messages of N steps to `<out>/captures` (`capture.Recorder`)."""

    def __init__(self, recorder):
        self.recorder = recorder

    def before_step(self, state, step):
        self.recorder.capture(step, state.params, state.inputs, state.targets)

    def on_step(self, state, step, rec):
        self.recorder.finish_step(step, rec["loss"])

    def end(self, state):
        captured = self.recorder.close()
        return {"captures": captured} if captured else None


class MonitorMeasure(Hook):
    """`--monitor-every N`: on due steps, the compressed-vs-exact SQNR of this step's messages
    (`monitor.Monitor.measure`), into the step's record as "monitor" and "monitor_s"."""

    def __init__(self, monitor):
        self.monitor = monitor

    def before_step(self, state, step):
        if not self.monitor.due(step):
            return None
        t = time.perf_counter()
        fidelity = self.monitor.measure(step, state.params, state.inputs, state.targets)
        return {"monitor": fidelity, "monitor_s": time.perf_counter() - t}

    def end(self, state):
        return {"monitor": monitor_summary(state.history, state.start)} if self.monitor.sites else None


class MonitorCheck(Hook):
    """The monitor's thresholds on a measured step, after its record is written: warnings, and
    `MonitorError` under `--monitor-min-sqnr`."""

    def __init__(self, monitor, metrics_path: str):
        self.monitor, self.metrics_path = monitor, metrics_path

    def on_step(self, state, step, rec):
        if "monitor" in rec:
            self.monitor.check(step, rec["monitor"], f" (metrics up to step {step} in {self.metrics_path})")


class CodecErrors(Hook):
    """A codec with nonfinite="error" saw NaN/Inf in a message this step: FloatingPointError naming the site."""

    def on_step(self, state, step, rec):
        raise_if_nonfinite()


class Evaluate(Hook):
    """Validation loss every `every` steps and at the last step (`rec["val_loss"]`), unless the
    step's loss or gradient norm is not finite (and `allow_nonfinite` is off). `evaluate(params,
    step)`: the loss (the loop guards each of its batches with the watchdog)."""

    def __init__(self, evaluate, every: int, last: int, allow_nonfinite: bool):
        self.evaluate, self.every, self.last, self.allow_nonfinite = evaluate, every, last, allow_nonfinite

    def on_step(self, state, step, rec):
        if (step % self.every == 0 or step == self.last) and (_finite(rec) or self.allow_nonfinite):
            state.val_loss = rec["val_loss"] = self.evaluate(state.params, step)


class MetricsLog(Hook):
    """`metrics.jsonl`: one strict-JSON line per step (process 0; a resumed run's kept records first),
    and `state.history`. Then stops the run with FloatingPointError naming the step when its loss or
    gradient norm is not finite (the bad step is logged first), unless `allow_nonfinite`."""

    def __init__(self, path, run_dir, history: list[dict], writer: bool, allow_nonfinite: bool):
        self.where, self.allow_nonfinite = rel(path, run_dir), allow_nonfinite
        self.file = open(path, "w") if writer else None
        for r in history:
            self._write(r)

    def _write(self, rec):
        if self.file:
            self.file.write(jsonio.dumps(rec) + "\n")
            self.file.flush()

    def on_step(self, state, step, rec):
        self._write(rec)
        state.history.append(rec)
        if not _finite(rec) and not self.allow_nonfinite:
            bad = ", ".join(f"{k}={rec[k]}" for k in ("loss", "grad_norm") if not math.isfinite(rec[k]))
            raise FloatingPointError(
                f"step {step}: {bad} is not finite (loss={rec['loss']:.6g}); the run stopped (metrics up to step "
                f"{step} in {self.where}; --allow-nonfinite keeps training)")

    def close(self):
        if self.file:
            self.file.close()


class Progress(Hook):
    """A progress bar on a terminal; with stderr not a terminal, a line every `log_every` steps and at
    the last (process 0 only; nothing when `show` is False). A line's val loss is the latest one,
    followed by "(step K)" when it was evaluated at an earlier step K."""

    def __init__(self, label: str, start: int, steps: int, log_every: int, show: bool):
        self.label, self.steps, self.log_every = label, steps, log_every
        self.bar = tqdm(desc=f"train[{label}]", dynamic_ncols=True, initial=start, total=steps, unit="step",
                        disable=None if show else True)  # None: no bar off a terminal
        self.lines = show and log_every and not sys.stderr.isatty()
        self.val_step = None  # the step of state.val_loss: a line names it when it is an earlier step's

    def on_step(self, state, step, rec):
        val = state.val_loss
        if "val_loss" in rec:
            self.val_step = step
        elif val is not None and self.val_step is None:  # evaluated before a resume
            self.val_step = next((r["step"] for r in reversed(state.history) if "val_loss" in r), None)
        self.bar.update(1)
        self.bar.set_postfix({"loss": f"{rec['loss']:.3f}", "val": f"{val:.3f}" if val else "-",
                              "tokens/s": f"{rec['tokens_per_s']:.0f}"})
        if self.lines and (step % self.log_every == 0 or step == self.steps):
            at = f" (step {self.val_step})" if val is not None and self.val_step != step else ""
            say(f"[train {self.label}] step {step}/{self.steps} loss {rec['loss']:.4f} val "
                f"{f'{val:.4f}' if val is not None else '-'}{at} {rec['tokens_per_s']:.0f} tokens/s")

    def close(self):
        self.bar.close()


class Preemption(Hook):
    """SIGTERM (preemption) -> `state.preempted` at a step boundary (the checkpoint hook saves, the
    loop stops). Several processes: JAX's preemption sync manager makes the step the same on all."""

    def __init__(self):
        self.multi, self.flag, self.old = jax.process_count() > 1, False, None
        if not self.multi and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_):
        self.flag = True

    def on_step(self, state, step, rec):
        if self.multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                state.preempted = step
        elif self.flag:
            state.preempted = step

    def close(self):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
            self.old = None


class Stopped(BaseException):
    """SIGTERM before the first step of a one-process run (`StopBeforeSteps`); its text is the line
    saying where the run was and what it keeps (`kept`). A BaseException, as KeyboardInterrupt: no
    `except Exception` on the way swallows it."""


def latest_checkpoint(out) -> pathlib.Path | None:
    """The latest complete checkpoint of the run in `out` (`checkpoint.saved_steps`: read from the folder
    names, without Orbax), or None."""
    from taco_jax.train.checkpoint import saved_steps

    steps = saved_steps(pathlib.Path(out) / "checkpoints")
    return pathlib.Path(out) / "checkpoints" / str(steps[-1]) if steps else None


def kept(out) -> str:
    """What a stopped run in `out` keeps, in words: its latest checkpoint and how to go on, or none."""
    latest = latest_checkpoint(out)
    return (f"the latest checkpoint is {latest} (continue with --resume)" if latest
            else f"no checkpoint in {pathlib.Path(out) / 'checkpoints'}")


class StopBeforeSteps(contextlib.AbstractContextManager):
    """SIGTERM before the first step of a one-process run: nothing to save, so the handler raises `Stopped` in the
    main thread at once (also during an XLA compilation), naming `phase` and what the run in `out` keeps. Set
    `phase` to None at the first step (the `Preemption` hook takes over); a SIGTERM after the hooks closed is
    ignored. With several processes nothing is installed (JAX's preemption notifier owns SIGTERM)."""

    def __init__(self, out):
        self.out, self.phase, self.old = out, "start-up", None

    def __enter__(self):
        one = not jax.distributed.is_initialized() or jax.process_count() == 1  # starts no backend for one
        if one and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _on_sigterm(self, *_):
        if self.phase is not None:
            latest = latest_checkpoint(self.out)
            first = int(latest.name) + 1 if latest else 1
            what = f"nothing new saved; {kept(self.out)}" if latest else "nothing trained, no checkpoint saved"
            raise Stopped(f"stopped by SIGTERM during {self.phase}, before step {first}: {what}")

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
            self.old = None


class Checkpoint(Hook):
    """Orbax checkpoints (`train/checkpoint.py`) every `every` steps (0: none), at the last step
    unless `final` is off, and on preemption, with the batch stream's position. `guard`:
    `StepWatchdog.guard` around each save and the final wait."""

    def __init__(self, ckpt, batches, every: int, steps: int, config: dict, run_dir, *, final: bool = True,
                 guard=None):
        self.ckpt, self.batches, self.every, self.steps, self.config = ckpt, batches, every, steps, config
        self.run_dir, self.final, self.guard, self.last = run_dir, final, guard or _no_guard, None

    def on_step(self, state, step, rec):
        if state.preempted or (self.every and step % self.every == 0) or (self.final and step == self.steps):
            nbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
            with self.guard(f"checkpoint of step {step}", step, kind="checkpoint", nbytes=nbytes):
                self.ckpt.save(step, state.params, state.opt_state, {"data": self.batches.state(),
                                                                     "config": self.config},
                               wait=bool(state.preempted))
            self.last = (step, nbytes)
        if state.preempted:
            say(f"[taco-jax] SIGTERM: checkpoint {rel(self.ckpt.directory / str(step), self.run_dir)} written; "
                f"the run stopped at step {step} (continue with --resume)")

    def end(self, state):
        if self.last is None:
            return
        step, nbytes = self.last
        with self.guard(f"checkpoint of step {step} (completing)", step, kind="checkpoint", nbytes=nbytes):
            self.ckpt.wait()  # the last save complete (raises its error)

    def close(self):
        self.ckpt.close()


def _finite(rec: dict) -> bool:
    return math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])


def monitor_summary(history: list[dict], start: int = 0) -> dict:
    """`summary.json`'s "monitor": per site the mean and minimum of `sqnr_db` and the minimum of
    `min_sqnr_db` over the monitored steps (NaN if any was NaN); the mean `monitor_s` and `step_s`
    of this process's steps after its first (which compiles)."""
    mon = [r for r in history if "monitor" in r and r["step"] > start]
    sites = {}
    for site in SITES:
        vals = [(float(r["monitor"][site]["sqnr_db"]), float(r["monitor"][site]["min_sqnr_db"]))
                for r in mon if site in r["monitor"]]
        if vals:
            worst = [v[1] for v in vals]
            sites[site] = {"mean_sqnr_db": float(np.mean([v[0] for v in vals])), "min_sqnr_db": float(np.min(worst)),
                           "first_sqnr_db": vals[0][0], "last_sqnr_db": vals[-1][0]}
    later = [r for r in history if r["step"] > start + 1]
    timed = [r["monitor_s"] for r in mon[1:]]  # the first measurement compiles the monitor
    step_s = float(np.mean([r["step_s"] for r in later])) if later else None
    monitor_s = float(np.mean(timed)) if timed else None
    return {"steps": [r["step"] for r in mon], "sites": sites, "monitor_s_mean": monitor_s, "step_s_mean": step_s,
            "monitor_over_step": monitor_s / step_s if monitor_s and step_s else None}
