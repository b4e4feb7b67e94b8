"""A model from a plain parameter dict: how a jitted function rebuilds its `nnx` module from arrays."""

from __future__ import annotations

import jax
from flax import nnx


def merge_params(graphdef: nnx.GraphDef, abstract_state: nnx.State, params: dict):
    """The module `graphdef` describes, holding `params`.

    Args:
      graphdef, abstract_state: `nnx.split(model, nnx.Param)` of a (possibly abstract) model.
      params: pure dict of arrays shaped like `nnx.to_pure_dict(abstract_state)` (tracers allowed).
    Returns: a fresh module (`abstract_state` is not modified).
    Raises: ValueError / KeyError from `nnx.replace_by_pure_dict` when `params` does not match.
    """
    state = jax.tree.map(lambda v: v, abstract_state)  # a fresh State to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
