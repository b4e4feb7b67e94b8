"""Child processes of taco_jax: the command line of a `taco-jax` child and the environment that makes it
import this copy of the package (launcher, emulated cluster, studies). Standard library only."""

from __future__ import annotations

import os
import pathlib
import site
import sys


def cli_command(*args: str) -> list[str]:
    """The command line of a child running `taco-jax ARGS` with this interpreter: `python -P -m
    taco_jax.cli ARGS...` (-P: the working folder is not on sys.path, so a folder holding another
    `taco_jax` does not shadow this one). Start it with `child_env(...)` as its environment."""
    return [sys.executable, "-P", "-m", "taco_jax.cli", *args]


def child_env(env: dict) -> dict:
    """A copy of `env` for a `python -P` child that imports this taco_jax: the folder holding the package first on
    PYTHONPATH, unless it is a site-packages folder (where the child finds it anyway) or already on PYTHONPATH."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = dict(env)
    sites = {str(pathlib.Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in sites and root not in {str(pathlib.Path(p).resolve()) for p in paths}:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env
