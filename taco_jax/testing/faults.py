"""Fault injection for tests that run real training processes (tests/test_distributed.py,
tests/test_resume_faults.py, tests/test_emulated_links.py, tests/test_runs_and_launcher.py).

Each fault is an environment variable of the child process, read only here; unset, nothing changes.
Production code reaches this module through `stall` (`train.distributed.StepWatchdog`) and
`meta_handler` (`train.checkpoint.Checkpoints`) only.

    TACO_JAX_TEST_STALL="PROCESS:WHEN:WHAT"   process PROCESS sleeps WHAT seconds, or stops itself
        (SIGSTOP) when WHAT is "stop", at WHEN: before step N ("N") or at the start of the evaluation
        after step N ("eval@N"). It prints one line first: "[taco-jax] TACO_JAX_TEST_STALL: process P
        sleeps S s <where>" / "... stops itself (SIGSTOP) <where>".
    TACO_JAX_TEST_SLOW_SAVE="SECONDS"          every checkpoint save's background write of its meta
        starts SECONDS late (the save stays in flight, its temporary folder not yet renamed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

ENV_STALL = "TACO_JAX_TEST_STALL"
ENV_SLOW_SAVE = "TACO_JAX_TEST_SLOW_SAVE"


def stall(when: str, process: int, where: str) -> None:
    """The `ENV_STALL` fault at point `when` ("N" or "eval@N") of process `process`; `where` is told
    in its line (e.g. "before step 3"). Raises ValueError naming a malformed value."""
    value = os.environ.get(ENV_STALL)
    if not value:
        return
    try:
        proc, at, what = value.split(":")
        proc = int(proc)
        seconds = None if what == "stop" else float(what)
    except ValueError:
        raise ValueError(f"{ENV_STALL}={value!r} must be PROCESS:WHEN:SECONDS or PROCESS:WHEN:stop") from None
    if proc != process or at != when:
        return
    from taco_jax.util.console import write_line

    if seconds is None:
        write_line(f"[taco-jax] {ENV_STALL}: process {proc} stops itself (SIGSTOP) {where}")
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        write_line(f"[taco-jax] {ENV_STALL}: process {proc} sleeps {what} s {where}")
        time.sleep(seconds)


def meta_handler():
    """Orbax's JSON handler whose background write sleeps `ENV_SLOW_SAVE` seconds first, or None when
    the variable is unset or 0 (then the caller uses Orbax's own)."""
    seconds = float(os.environ.get(ENV_SLOW_SAVE, 0) or 0)
    if seconds <= 0:
        return None
    import asyncio

    import orbax.checkpoint as ocp

    class SlowJson(ocp.JsonCheckpointHandler):
        async def _save_fn(self, x, directory):
            print(f"[taco-jax] {ENV_SLOW_SAVE}: the save into {directory} sleeps {seconds:g} s", file=sys.stderr,
                  flush=True)
            await asyncio.sleep(seconds)
            await super()._save_fn(x, directory)

    return SlowJson()
