"""The one place the kernels ask which platform jax runs on (name as `jax.export` spells it)."""

from __future__ import annotations

import contextvars

import jax

#: (platform, gpu_lowering) pinned by `taco_jax.kernels.pallas_codec.lowering_platform`, else None.
PINNED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("taco_platform", default=None)


def pinned_platform() -> str | None:
    """The platform pinned by an enclosing `pallas_codec.lowering_platform(...)`, else None."""
    pinned = PINNED.get()
    return None if pinned is None else pinned[0]


def default_platform() -> str:
    """The platform the kernels are traced for: the pinned one (`pinned_platform`), else jax's
    default platform: "cpu", "cuda", "rocm" or "tpu" ("gpu" is reported as "cuda")."""
    pinned = pinned_platform()
    if pinned is not None:
        return pinned
    p = jax.default_backend()
    return "cuda" if p == "gpu" else p
