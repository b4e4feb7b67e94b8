"""Helpers shared by the studies of `experiments/`: the checkout's root, simulated CPU devices,
child processes of a study and the git commit of a result.

Imports only the standard library and `taco_jax.util`, so a study can use it before it imports jax.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    """The command line that runs the study `module` (e.g. "experiments.step_time") with this
    interpreter: [sys.executable, "-m", module, *args]. Run it with cwd=ROOT or `child_env()`."""
    return [sys.executable, "-m", module, *args]


def git_commit() -> str | None:
    """The checkout's HEAD commit (40 hex digits), or None where git or the repository is missing."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
