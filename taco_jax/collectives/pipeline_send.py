"""Pipeline stage-to-stage transfer over the `stage` axis, compressed per `CommPolicy.pp_send`
(TACO spec §4); the derivative is `lax.ppermute`'s, its message compressed too."""

from __future__ import annotations

import jax
from jax import lax

from taco_jax.codec import CodecConfig
from taco_jax.collectives import compressed
from taco_jax.collectives.hlo import site_scope
from taco_jax.collectives.policy import CommPolicy


def send(x: jax.Array, axis_name: str, policy: CommPolicy, shift: int = 1, *,
         bwd_codec: CodecConfig | None = None) -> jax.Array:
    """Stage s -> s + shift (+1: next stage, -1: previous) over the stage axis `axis_name`, no
    wrap-around. x: any shape and float dtype. Returns: x's shape and dtype, stage s holding stage
    s - shift's x (zeros where none is sent). bwd_codec: the gradient's (default: the forward codec)."""
    n = lax.axis_size(axis_name)
    perm = [(i, i + shift) for i in range(n) if 0 <= i + shift < n]
    with site_scope("pp_send"):
        return compressed.ppermute(x, axis_name, perm, codec=policy.codec_for("pp_send", x), bwd_codec=bwd_codec)
