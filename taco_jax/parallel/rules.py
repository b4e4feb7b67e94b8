"""One table mapping logical axis names of weights and activations to mesh axes (MaxText style)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

#: logical axis -> mesh axis (None = replicated). Layers only name logical axes.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed": None,
    "head_dim": None,
    "qkv": None,
    "position": None,
    "layers": "stage",  # stacked decoder layers (pipeline layout, parallel/pipeline.py)
}


def logical_to_spec(axes: tuple[str | None, ...] | None, mesh_axis_names, rules=None) -> P:
    """PartitionSpec for a tensor whose dims carry `axes` logical names; unknown mesh axes -> None.
    Raises: ValueError for a logical name missing from the rules."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    if axes is None:
        return P()
    out = []
    for a in axes:
        if a is not None and a not in rules:
            raise ValueError(f"logical axis {a!r} has no sharding rule; known: {sorted(rules)}")
        m = None if a is None else rules[a]
        out.append(m if m in mesh_axis_names else None)
    return P(*out)


def param_specs(state: nnx.State, mesh_axis_names, rules=None):
    """Pure-dict pytree of PartitionSpecs for an `nnx.State` of Params (metadata key `axes`)."""

    def spec(v):
        return logical_to_spec(getattr(v, "axes", None), mesh_axis_names, rules)

    specs = jax.tree.map(spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(specs) if isinstance(specs, nnx.State) else specs
