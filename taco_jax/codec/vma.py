"""Varying-manual-axes (vma) helpers, so values keep their varying type inside `shard_map(check_vma=True)`.

The one home of these helpers for every floor (kernels, collectives, train): it sits at the lowest
floor so that no module above has to reach into another floor's internals for them
(`taco_jax.collectives.dp.varying_axes` / `vary` are the same two functions).

The type is spelled `ShapedArray.manual_axis_type` (`jax.sharding.ManualAxisType`) in some jax
versions and `aval.vma` in others; both are read. A custom call whose output type lacks the inputs'
varying axes would be taken as replicated (invariant) by later collectives, so every kernel
declares it explicitly.
"""

from __future__ import annotations

import jax


def vma_of(x) -> frozenset:
    """Mesh axes `x` varies over inside `shard_map` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def shape_dtype(shape, dtype, vma: frozenset) -> jax.ShapeDtypeStruct:
    """A `ShapeDtypeStruct` varying over `vma` (as `out_shape` / ffi result types need)."""
    if hasattr(jax.sharding, "ManualAxisType"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=vma))
    if vma:
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
    return jax.ShapeDtypeStruct(shape, dtype)


def pvary(x, vma):
    """Marks `x` as varying over the axes of `vma` (any iterable of axis names; None entries are
    ignored) it does not vary over yet; identity forward."""
    missing = tuple(sorted({a for a in vma if a is not None} - vma_of(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)
