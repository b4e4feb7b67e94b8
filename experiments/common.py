"""Helpers shared by the studies of `experiments/`: the checkout's root, simulated CPU devices,
child processes of a study, the git commit of a result, and light imports of `taco_jax.train`.

Imports only the standard library, so a study can use it before it imports jax.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

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
    """A copy of `base` (default `os.environ`) in which `python -m experiments.NAME` imports this
    checkout: ROOT first on PYTHONPATH, output unbuffered."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


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


def light_import(module: str):
    """`module` of taco_jax.train that imports only the standard library and numpy at module level
    (jsonio, distributed), loaded from its file without running `taco_jax.train.__init__`, which
    imports the models (about 1 s of CPU per process on a 2-core machine, paid by every worker).
    Raises FileNotFoundError naming the module's file if it does not exist."""
    name = f"_experiments_light_{module.rpartition('.')[2]}"
    if name in sys.modules:
        return sys.modules[name]
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        raise FileNotFoundError(f"{module}: no file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
