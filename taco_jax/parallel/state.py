"""A model from a plain parameter dict: how a jitted function rebuilds its `nnx` module from arrays."""

from __future__ import annotations

import jax
from flax import nnx


def merge_params(graphdef: nnx.GraphDef, abstract_state: nnx.State, params: dict):
    """A fresh module of `graphdef` holding `params` (a pure dict shaped like
    `nnx.to_pure_dict(abstract_state)`, tracers allowed); (graphdef, abstract_state) =
    `nnx.split(model, nnx.Param)`, not modified. Raises: ValueError / KeyError from
    `nnx.replace_by_pure_dict` when `params` does not match.
    """
    state = jax.tree.map(lambda v: v, abstract_state)  # a fresh State to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def sharded_initializer(fn, shardings):
    """A jitted function computing `fn()` (a no-argument initialisation) straight into `shardings`:
    each device computes only its shards.

    Values equal eager `fn()` bit for bit: an optimization barrier after every top-level operation
    stops XLA fusing e.g. `* stddev` into the sampler (which rounds some values 1 ulp differently).
    Raises what `fn` raises while tracing; ValueError from `jax.jit` if `shardings` does not match.
    """
    from jax.extend.core import Literal

    closed = jax.make_jaxpr(fn)()
    tree = jax.tree.structure(jax.eval_shape(fn))

    def eager_units():
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
        for eqn in closed.jaxpr.eqns:
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
            out = jax.lax.optimization_barrier(list(out) if eqn.primitive.multiple_results else [out])
            env.update(zip(eqn.outvars, out, strict=True))
        return jax.tree.unflatten(tree, [read(v) for v in closed.jaxpr.outvars])

    return jax.jit(eager_units, out_shardings=shardings)
