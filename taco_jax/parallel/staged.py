"""A model cut into embed -> L identical layers -> head, and its stacked parameter layout for pipelining.

Layout: the decoder layers' parameters are *stacked* — every layer-parameter leaf gets a leading
`layers` axis of size L, sharded over the `stage` mesh axis (logical axis "layers"), so stage s
holds layers [s·L/S, (s+1)·L/S) — and all other parameters (embedding, final norm, LM head,
GPT's position table) are replicated over stages.

A model class takes part by declaring `pipeline_layers` (the attribute holding its `nnx.List`
of identical layers) and the methods `embed(ids)` (int32 [B, T] -> hidden [B, T(/tp), D]) and
`head_loss(x, targets)` (final hidden states -> mean cross-entropy), so this module never
imports `taco_jax.models`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from taco_jax.parallel.rules import logical_to_spec


@dataclasses.dataclass(frozen=True, eq=False)
class StagedModel:
    """A model cut into embed -> L identical layers -> head, with its parameters in pipeline layout
    (module docstring: `params[layer_key]` one tree of stacked leaves, `stack_layers`)."""

    graphdef: nnx.GraphDef
    state: nnx.State  # abstract, whole model
    layer_key: str  # the model class's `pipeline_layers` ("h" for GPT, "layers" for Qwen)
    n_layers: int
    layer_graphdef: nnx.GraphDef
    layer_state: nnx.State  # abstract, one layer
    embed: Callable  # (model, ids [B, T]) -> x [B, T(/tp), D]
    head_loss: Callable  # (model, x, targets [B, T]) -> mean cross-entropy

    @classmethod
    def from_model(cls, model) -> StagedModel:
        """From an (abstract) model whose class declares `pipeline_layers`, `embed` and `head_loss`
        (module docstring). Raises: ValueError naming the model class if it lacks one or has no layers.
        """
        kind = type(model)
        key = getattr(kind, "pipeline_layers", None)
        missing = [n for n, ok in (("pipeline_layers", isinstance(key, str)), ("embed", hasattr(kind, "embed")),
                                   ("head_loss", hasattr(kind, "head_loss"))) if not ok]
        if missing:
            raise ValueError(f"no pipeline split for {kind.__name__}: its class lacks {', '.join(missing)}")
        layers = getattr(model, key)
        if len(layers) == 0:
            raise ValueError(f"no pipeline split for {kind.__name__}: {key!r} holds no layers")
        graphdef, state = nnx.split(model, nnx.Param)
        layer_graphdef, layer_state = nnx.split(layers[0], nnx.Param)
        return cls(graphdef, state, key, len(layers), layer_graphdef, layer_state, kind.embed, kind.head_loss)

    # -- parameter layout
    def stack_layers(self, params: dict) -> dict:
        """Model pure dict -> pipeline layout (layer i of the stack = params[layer_key][i])."""
        layers = params[self.layer_key]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(self.n_layers)])
        return {**params, self.layer_key: stacked}

    def unstack_layers(self, params: dict) -> dict:
        """Pipeline layout -> model pure dict."""
        stacked = params[self.layer_key]
        return {**params, self.layer_key: {i: jax.tree.map(lambda a, i=i: a[i], stacked)
                                           for i in range(self.n_layers)}}

    def specs(self, mesh_axis_names, rules=None) -> dict:
        """PartitionSpecs of the pipeline layout: stacked leaves get the logical axis "layers" first."""

        def spec(v):
            return logical_to_spec(getattr(v, "axes", None), mesh_axis_names, rules)

        def stacked_spec(v):
            return logical_to_spec(("layers", *(getattr(v, "axes", None) or (None,) * v.ndim)), mesh_axis_names,
                                   rules)

        is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
        full = nnx.to_pure_dict(jax.tree.map(spec, self.state, is_leaf=is_var))
        full[self.layer_key] = nnx.to_pure_dict(jax.tree.map(stacked_spec, self.layer_state, is_leaf=is_var))
        return full

    # -- pieces, used inside shard_map on local shards
    def _merge(self, graphdef, state, pure):
        st = jax.tree.map(lambda v: v, state)  # fresh State to fill in
        nnx.replace_by_pure_dict(st, pure)
        return nnx.merge(graphdef, st)

    def outer(self, params: dict):
        """The model with the non-layer parameters (its layers hold a placeholder and must not be called)."""
        layer0 = jax.tree.map(lambda a: a[0], params[self.layer_key])
        return self._merge(self.graphdef, self.state,
                           {**params, self.layer_key: {i: layer0 for i in range(self.n_layers)}})

    def stage_forward(self, layers: dict, x: jax.Array) -> jax.Array:
        """This stage's layers (local stack [L/S, ...]) applied in order to x [b, T(/tp), D]."""
        for i in range(jax.tree.leaves(layers)[0].shape[0]):
            x = self._merge(self.layer_graphdef, self.layer_state, jax.tree.map(lambda a, i=i: a[i], layers))(x)
        return x
