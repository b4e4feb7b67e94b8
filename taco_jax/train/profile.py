"""`taco-jax train --profile-steps A:B`: a `jax.profiler` trace of steps A..B (a loop hook).

The trace goes to `--profile-dir` (default `<out>/profile`; process i of a multi-process run:
`<dir>/process<i>`) in the layout TensorBoard's profile plugin and XProf read:
`plugins/profile/<time>/<host>.xplane.pb` (and `<host>.trace.json.gz`), plus
`perfetto_trace.json.gz` (ui.perfetto.dev; `python -m experiments.tp_overlap_trace --from-trace DIR`
reads its thunks' concurrency). Each traced step is a
`StepTraceAnnotation` ("train_step", its number); the compiled program's ops carry the named scopes
of the compressed collectives (`taco_encode`, `taco_decode`, `taco_reduce`, `taco_psum`,
`taco_all_gather`, ...) in their op names, which the profiler's views group by.
"""

from __future__ import annotations

import pathlib

import jax

from taco_jax.train.hooks import Hook


def profile_dir(cfg) -> pathlib.Path:
    """Where the trace of a `TrainConfig` goes (see the module docstring)."""
    base = pathlib.Path(cfg.logging.profile_dir or pathlib.Path(cfg.checkpoint.out) / "profile")
    return base / f"process{jax.process_index()}" if jax.process_count() > 1 else base


class ProfileSteps(Hook):
    """Traces steps `first`..`last` into `directory` (a resumed run past `first` starts at its first step)."""

    def __init__(self, first: int, last: int, directory):
        self.first, self.last, self.directory = first, last, pathlib.Path(directory)
        self.tracing, self.step_annotation = False, None

    def before_step(self, state, step):
        if not self.tracing and self.first <= step <= self.last:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.tracing = True
        if self.tracing:
            self.step_annotation = jax.profiler.StepTraceAnnotation("train_step", step_num=step)
            self.step_annotation.__enter__()

    def on_step(self, state, step, rec):
        if self.step_annotation is not None:
            self.step_annotation.__exit__(None, None, None)
            self.step_annotation = None
        if self.tracing and step >= self.last:
            self.close()

    def end(self, state):
        self.close()

    def close(self):
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
