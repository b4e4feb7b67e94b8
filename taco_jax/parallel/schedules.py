"""GPipe and 1F1B microbatch schedules in one SPMD program (inside `shard_map` over data, stage, tensor).

Every stage runs the same program; an idle stage computes on masked-out data ("SPMD pipeline", as
MaxText's). Transfers are `collectives.pipeline_send.send`; gradients of stage-replicated
parameters (a tied embedding) are summed over stages exactly.

- "gpipe": M + S - 1 forward ticks (microbatch m on stage s at tick m + s); `jax.grad` through
  the unrolled loop gives the mirrored backward. Memory O(M).
- "1f1b": M + 2S - 2 ticks of one forward and one backward slot (backward of m on stage s at tick
  m + 2S - 2 - s); only stage inputs are kept (min(M, 2S - 1) slots) and the forward is recomputed.
  Memory O(S); costs S - 1 more ticks and the recomputation (`schedule_math.schedule_stats`).

Loops are unrolled (static ticks and layers), so `collectives.hlo` counts every collective exactly.
Source: GPipe (Huang et al. 2019), PipeDream-flush / 1F1B (Narayanan et al. 2021),
Megatron-LM `schedules.py`; TACO spec §4 (compressed pipeline send/recv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax.collectives.dp import vary, varying_axes
from taco_jax.collectives.pipeline_send import send
from taco_jax.collectives.policy import CommPolicy
from taco_jax.parallel.schedule_math import SCHEDULES
from taco_jax.parallel.staged import StagedModel


def _stage_info(stage_axis):
    if stage_axis is None:
        return 1, 0
    return lax.axis_size(stage_axis), lax.axis_index(stage_axis)


def _microbatches(a: jax.Array, m: int) -> jax.Array:
    if a.shape[0] % m:
        raise ValueError(f"local batch {a.shape[0]} is not divisible by microbatches={m}")
    return a.reshape(m, a.shape[0] // m, *a.shape[1:])  # [M, b, T]


def _like(value, ref):
    """`value` (a scalar or array) cast to ref's dtype and varying axes, broadcast to ref's shape."""
    out = jnp.broadcast_to(jnp.asarray(value, ref.dtype), ref.shape)
    return vary(out, varying_axes(ref))


def _after(x, dep, never):
    """x, unchanged, but computed only after `dep` (same shape and varying axes): `never` is a runtime
    predicate the compiler cannot prove false. An ordering edge that survives XLA:CPU, which drops
    `lax.optimization_barrier` before scheduling."""
    return jnp.where(never, dep.astype(x.dtype), x)


def _tie(params, grads, never):
    """Each parameter made to depend on its gradient accumulator (`_after`): the next tick, which
    reads the parameters, starts after this tick's weight gradients, so its activations are freed."""
    return jax.tree.map(lambda p, g: _after(p, g, never) if varying_axes(p) == varying_axes(g) else p, params, grads)


def gpipe_loss(sm: StagedModel, params: dict, ids, targets, *, microbatches: int, stage_axis: str | None,
               policy: CommPolicy) -> jax.Array:
    """Mean cross-entropy over this data shard's M microbatches as a GPipe forward (its gradient is
    GPipe's backward). params: pipeline layout, local shards, varying over `stage_axis`; ids, targets:
    int32 [B_local, T]. Returns a scalar, invariant over the stage and tensor axes."""
    n_stages, stage = _stage_info(stage_axis)
    outer = sm.outer(params)
    ids, targets = _microbatches(ids, microbatches), _microbatches(targets, microbatches)
    total, recv = 0.0, None
    for t in range(microbatches + n_stages - 1):
        x = sm.embed(outer, ids[t]) if t < microbatches else None  # [b, T(/tp), D]
        if n_stages > 1:
            x = recv if x is None else (x if recv is None else jnp.where(stage == 0, x, recv))
        y = sm.stage_forward(params[sm.layer_key], x)
        m = t - (n_stages - 1)  # microbatch leaving the last stage
        if m >= 0:
            loss = sm.head_loss(outer, y, targets[m])
            total = total + (jnp.where(stage == n_stages - 1, loss, 0.0) if n_stages > 1 else loss)
        if n_stages > 1 and t < microbatches + n_stages - 2:
            recv = send(y, stage_axis, policy, 1)
    if n_stages > 1:
        total = lax.psum(total, stage_axis)
    return total / microbatches


def one_f_one_b(sm: StagedModel, params: dict, ids, targets, *, microbatches: int, stage_axis: str | None,
                policy: CommPolicy, loss_scale: float = 1.0):
    """1F1B: (mean loss, gradient of loss_scale · mean loss), inputs as `gpipe_loss`. Gradients are per
    stage; the caller sums the stage-replicated ones over stages (`value_and_grad`)."""
    n_stages, stage = _stage_info(stage_axis)
    mb = microbatches
    ids, targets = _microbatches(ids, mb), _microbatches(targets, mb)
    layers = params[sm.layer_key]
    outer_params = {k: v for k, v in params.items() if k != sm.layer_key}

    def embed(op, i):
        return sm.embed(sm.outer({**op, sm.layer_key: layers}), ids[i])

    def head(op, y, i):
        return sm.head_loss(sm.outer({**op, sm.layer_key: layers}), y, targets[i])

    x0 = embed(outer_params, 0)
    n_slots = min(mb, 2 * n_stages - 1)  # in-flight stage inputs on stage 0
    stash = jnp.zeros((n_slots, *x0.shape), x0.dtype)
    recv_f = recv_b = None
    g_layers = jax.tree.map(jnp.zeros_like, layers)
    g_outer = jax.tree.map(jnp.zeros_like, outer_params)
    total = 0.0
    is_first, is_last = stage == 0, stage == n_stages - 1
    never = ids[0, 0, 0] < 0  # token ids are >= 0; only orders the ticks (see `_after`)
    n_ticks = mb + 2 * n_stages - 2
    for t in range(n_ticks):
        # 1. forward slot: microbatch t - s
        x = x0 if t == 0 else (embed(outer_params, t) if t < mb else None)
        if n_stages > 1:
            x = recv_f if x is None else (x if recv_f is None else jnp.where(is_first, x, recv_f))
        m_f = t - stage
        slot = jnp.mod(m_f, n_slots)
        keep = (m_f >= 0) & (m_f < mb)
        stash = stash.at[slot].set(jnp.where(keep, x, stash[slot]))
        y = sm.stage_forward(layers, x)
        # 2. loss on the last stage: microbatch t - (S-1), and the gradient it sends back
        ct_y = None
        m_h = t - (n_stages - 1)
        if 0 <= m_h < mb:
            loss, head_vjp = jax.vjp(lambda op, yy, i=m_h: head(op, yy, i), outer_params, y)
            total = total + (jnp.where(is_last, loss, 0.0) if n_stages > 1 else loss)
            g_o, ct_y = head_vjp(_like(jnp.where(is_last, loss_scale / mb, 0.0), loss))
            g_outer = jax.tree.map(jnp.add, g_outer, g_o)
        # 3. backward slot: microbatch t - (2S-2-s), recomputing the stage forward from its input
        m_b = t - (2 * n_stages - 2 - stage)
        if n_stages > 1:
            recv = jnp.zeros_like(y) if recv_b is None else recv_b
            ct_y = recv if ct_y is None else jnp.where(is_last, ct_y, recv)
            ct_y = jnp.where((m_b >= 0) & (m_b < mb), ct_y, 0.0)
        if ct_y is not None:
            _, stage_vjp = jax.vjp(sm.stage_forward, layers, stash[jnp.mod(m_b, n_slots)])
            g_l, ct_x = stage_vjp(ct_y)
            g_layers = jax.tree.map(jnp.add, g_layers, g_l)
            # 4. embedding backward on the first stage: microbatch t - (2S-2)
            m_e = t - (2 * n_stages - 2)
            if 0 <= m_e < mb:
                _, embed_vjp = jax.vjp(lambda op, i=m_e: embed(op, i), outer_params)
                ct_e = jnp.where(is_first, ct_x, 0.0) if n_stages > 1 else ct_x
                g_outer = jax.tree.map(jnp.add, g_outer, embed_vjp(ct_e)[0])
        # 5. transfers for the next tick, and ordering: the next tick runs after this one's backward
        #    (else the compiler hoists all forwards first and GPipe's memory is back)
        if n_stages > 1 and t < n_ticks - 1:
            recv_f = send(y, stage_axis, policy, 1)
            recv_b = send(ct_x, stage_axis, policy, -1) if ct_y is not None else None
        if recv_f is not None and varying_axes(recv_f) == varying_axes(recv_b):
            recv_f = _after(recv_f, recv_b, never)
        layers, outer_params = _tie(layers, g_layers, never), _tie(outer_params, g_outer, never)
    if n_stages > 1:
        total = lax.psum(total, stage_axis)
    return total / mb, {**g_outer, sm.layer_key: g_layers}


def value_and_grad(sm: StagedModel, params: dict, ids, targets, *, schedule: str, microbatches: int,
                   stage_axis: str | None, policy: CommPolicy, loss_scale: float = 1.0):
    """(mean loss, gradient of loss_scale · mean loss) of this data shard under `schedule`.

    params: pipeline layout, local shards. Gradients of the stage-replicated (non-layer)
    parameters are summed over `stage_axis` here (exact FP32 all-reduce); the layer stack's stay
    per stage. The gradients vary over `params`' axes plus any the inputs add.
    """
    outer_keys = [k for k in params if k != sm.layer_key]
    if stage_axis is not None:  # per-stage gradients of stage-replicated params, summed below
        params = {k: (jax.tree.map(lambda a: vary(a, (stage_axis,)), v) if k in outer_keys else v)
                  for k, v in params.items()}
    if schedule == "gpipe":
        def scaled(p):
            loss = gpipe_loss(sm, p, ids, targets, microbatches=microbatches, stage_axis=stage_axis, policy=policy)
            return loss * loss_scale, loss

        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    elif schedule == "1f1b":
        loss, grads = one_f_one_b(sm, params, ids, targets, microbatches=microbatches, stage_axis=stage_axis,
                                  policy=policy, loss_scale=loss_scale)
    else:
        raise ValueError(f"schedule={schedule!r} is not supported; choose one of {SCHEDULES}")
    if stage_axis is not None:
        grads = {k: (jax.tree.map(lambda g: lax.psum(g, stage_axis), v) if k in outer_keys else v)
                 for k, v in grads.items()}
    return loss, grads
