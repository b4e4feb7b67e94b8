"""Helpers of the multi-process and checkpoint tests: real `taco_jax.cli` processes (no mocks), each
with a bounded timeout, sharing one persistent compilation cache so that repeated configurations
compile once."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: A tiny run: seconds per step on 2 loaded cores. No final checkpoint (Orbax's first save in a process
#: compiles its slicing of every shard: seconds); the tests of the final checkpoint give --final-checkpoint.
#: No evaluation (tracing and compiling the eval step: about a second of a child's 5-6 CPU s with a warm
#: compilation cache); the tests that read validation losses give --eval-batches 1 (the last flag wins).
TINY = ["--model", "gpt2-tiny", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "0",
        "--log-every", "1", "--no-final-checkpoint", "--seed", "0"]


#: XLA flags of the test process and of every child it starts, for compile speed: XLA:CPU's LLVM
#: backend at -O0 (`TACO_TEST_XLA_OPT`, default 0), and at -O0 also XLA:CPU's older loop emitters
#: instead of its fusion emitters. Compile CPU time on the 2-core AMD VM, one process each (gpt2-tiny
#: train step on data=2,tensor=4, taco): 12.9 s at the defaults, 6.8 s at -O0, 5.8 s with the loop
#: emitters; a tiny eager op (thousands in a cold suite) 43 -> 27 ms. (The concurrency-optimized
#: scheduler's off switch saved 0.3 s more but changed the compiled temp memory: block remat then no
#: longer lowered it, `test_mixed_precision.py`; not used.) At -O0, no Eigen thread pool inside an op
#: either: the suite's 2 workers and their children already fill the 2 cores. Three concurrent cold
#: gpt2-tiny train processes took 9.5-9.7 CPU s each with it, 11.2-11.5 without; one in-process pair of
#: test files alone, 34.4-34.8 against 33.2-33.7 CPU s (the same within noise; Zen 4 VM). The HLO and
#: the wire bytes do not depend on these flags; float results do (code generation and the split of a
#: matmul differ, e.g. in FMA fusion; through bf16 roundings and FP8 codes a bf16 run's losses move by
#: ~1e-4 and its grad norms by up to 1e-3 relative), so every comparison in the suite is between
#: programs compiled alike (`test_environment.py` checks the suite's flags against the defaults).
#: `make test TACO_TEST_XLA_OPT=3` runs the suite as users compile (no flag of these).
#: jaxlib 0.11 removed the loop emitters' switch (its XLA aborts on an unknown flag), so it is given only
#: where jaxlib still has it.
_OPT = os.environ.get("TACO_TEST_XLA_OPT", "0")
_LOOP_EMITTERS = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
TEST_XLA_FLAGS = " ".join((f"--xla_backend_optimization_level={_OPT}",) + (
    (("--xla_cpu_use_fusion_emitters=false",) if _LOOP_EMITTERS else ()) + ("--xla_cpu_multi_thread_eigen=false",)
    if _OPT == "0" else ()))
#: The persistent compilation cache settings of the test process and its children (tests/conftest.py).
CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY": "1"}


def env(cache_dir, **extra) -> dict:
    """Environment of a child: this worktree first on the path, CPU only, the shared compilation
    cache, and the tests' XLA flags without a device count (the CLI / launcher set it from the mesh)."""
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS",
                                                           "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                                                           "TRITON_INTERPRET")}  # set by collecting
    # tests/test_triton_interpret.py in every worker; a child compiling real Triton kernels must not inherit it
    e.update({"PYTHONPATH": str(ROOT), "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu",
              "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
              **CACHE_ENV, "PYTHONUNBUFFERED": "1", **extra})
    return e


def cli(*args, processes: int = 0) -> list[str]:
    """The command of `taco_jax.cli args` (through `launch --processes N` when N > 0)."""
    pre = ["launch", "--processes", str(processes), "--"] if processes else []
    return [sys.executable, "-m", "taco_jax.cli", *pre, *map(str, args)]


def run(cmd, cache_dir, *, timeout: float = 420, **extra) -> subprocess.CompletedProcess:
    """Runs `cmd` to its end; after `timeout` s its whole process group is killed (a launcher's
    children die with it: `launch._die_with_parent`) and the test fails: nothing hangs or lingers."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(cache_dir, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout} s\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start(cmd, cache_dir, log_path, **extra) -> subprocess.Popen:
    """Starts `cmd` with stdout + stderr into `log_path` (read it with `wait_for`)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env(cache_dir, **extra), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(pred, proc, *, timeout: float, what: str, log=None) -> float:
    """Polls `pred()` every 50 ms until true (returns the time.monotonic() it became true); fails
    the test (showing the end of the file `log`) when `proc` ended first or `timeout` s passed."""
    tail = lambda: pathlib.Path(log).read_text()[-3000:] if log else ""  # noqa: E731
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return time.monotonic()
        if proc.poll() is not None:
            raise AssertionError(f"process ended (status {proc.returncode}) before {what}\n{tail()}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # started in its own session: the group is its processes
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail()}")


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in open(pathlib.Path(out) / "metrics.jsonl")]


def losses(out) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of every step record."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(out)]
