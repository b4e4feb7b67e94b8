"""Parse `data=2,tensor=4` mesh specs and build a `jax.sharding.Mesh` (Auto axis types)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

#: The mesh axes, in mesh order: data parallel, pipeline stages, tensor parallel (the one table of names).
MESH_AXES = ("data", "stage", "tensor")
DATA, STAGE, TENSOR = MESH_AXES


def parse_mesh(spec: str) -> dict[str, int]:
    """"data=2,tensor=4" -> {"data": 2, "tensor": 4} (axis order as written).
    Raises: ValueError for a malformed entry, an unknown axis name, a repeated axis or a size < 1."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.partition("=")
        if name not in MESH_AXES:
            raise ValueError(f"mesh axis {name!r} in mesh={spec!r} is not one of {MESH_AXES}")
        if name in out:
            raise ValueError(f"mesh axis {name!r} appears twice in mesh={spec!r}")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"mesh axis size {size!r} in mesh={spec!r} must be a positive integer")
        out[name] = int(size)
    if not out:
        raise ValueError(f"mesh={spec!r} names no axis; write e.g. 'data=2,tensor=4'")
    return out


def make_mesh(axes: dict[str, int], devices=None) -> Mesh:
    """A mesh over the first prod(sizes) devices, axes in the given order.
    Raises: ValueError if the mesh needs more devices than exist or does not use them all."""
    devices = jax.devices() if devices is None else devices
    n = math.prod(axes.values())
    if n != len(devices):
        raise ValueError(
            f"mesh {axes} needs {n} devices but {len(devices)} are available "
            f"(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax)"
        )
    return Mesh(np.asarray(devices).reshape(tuple(axes.values())), tuple(axes))
