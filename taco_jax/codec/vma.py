"""Varying-manual-axes (vma) helpers for `shard_map(check_vma=True)`, on the lowest floor for every user.

jax spells the type `aval.manual_axis_type` or `aval.vma` by version; both are read. Every kernel
declares its outputs' varying axes: otherwise later collectives would take them as invariant."""

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
