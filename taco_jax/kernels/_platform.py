"""The one place the kernels ask which platform jax runs on (name as `jax.export` spells it)."""

from __future__ import annotations

import jax


def default_platform() -> str:
    """jax's default platform: "cpu", "cuda", "rocm" or "tpu" ("gpu" is reported as "cuda")."""
    p = jax.default_backend()
    return "cuda" if p == "gpu" else p
