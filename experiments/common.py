"""Helpers shared by the studies of `experiments/`: the checkout's root, simulated CPU devices,
child processes of a study and the record every result JSON carries (`run_record`).

Imports only the standard library and `taco_jax.util`, so a study can use it before it imports jax.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from taco_jax.util import procs

#: The repository root (the folder holding `taco_jax/` and `experiments/`).
ROOT = Path(__file__).resolve().parents[1]

_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def cpu_devices(n: int, *, force: bool = False) -> None:
    """Asks XLA for `n` simulated CPU devices and JAX for the CPU platform, unless the environment
    already chose (`force=True`: replace a device count set in XLA_FLAGS). Only takes effect
    before jax starts its backend: call it before the first `import jax` of the process.
    Raises ValueError if `n` < 1."""
    if n < 1:
        raise ValueError(f"device count must be >= 1, got {n}")
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT.search(flags) and not force:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return
    kept = " ".join(_DEVICE_COUNT.sub("", flags).split())
    os.environ["XLA_FLAGS"] = f"{kept} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def child_env(base: dict | None = None) -> dict:
    """`taco_jax.util.procs.child_env` of `base` (default `os.environ`: this checkout first on PYTHONPATH, so
    `python -m experiments.NAME` imports it), output unbuffered."""
    return procs.child_env(os.environ if base is None else base) | {"PYTHONUNBUFFERED": "1"}


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs the study `module` (e.g. "experiments.step.step_time") with this
    interpreter: [sys.executable, "-m", module, *args]. Run it with cwd=ROOT or `child_env()`."""
    return [sys.executable, "-m", module, *args]


def git_commit() -> str | None:
    """The checkout's HEAD commit (40 hex digits), or None where git or the repository is missing."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def host() -> dict:
    """This machine: {"cpu": the CPU model (/proc/cpuinfo's "model name", else `platform.processor()`
    or `platform.machine()`), "cores": `os.cpu_count()`}."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count()}


def run_record(module: str, argv: Sequence[str] | None = None) -> dict:
    """The record of one run that every study's result JSON holds under "run":
    command  "python -m MODULE ARGS..." (shell-quoted; `argv` default `sys.argv[1:]`),
    commit   `git_commit()` (None outside a git checkout),
    host     `host()`: CPU model and core count,
    load     `os.getloadavg()` now, [1, 5, 15 min] (None where the OS has none),
    date     now, UTC, ISO 8601 to the second ("2026-12-06T10:17:21+00:00").
    A study passes its own module name, `__spec__.name` (e.g. "experiments.e2e.bench_e2e")."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {"command": shlex.join(["python", "-m", module, *args]), "commit": git_commit(), "host": host(),
            "load": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "date": datetime.now(UTC).isoformat(timespec="seconds")}
