"""Triton fused TACO codec (spec §2) called through jax-triton; GPU only, imported lazily.

Same math as `pallas_codec` (one program per block of groups; the Hadamard transform as an
IEEE-fp32 `tl.dot` with column chunks of the ±1 Sylvester matrix), written directly in Triton.
Encode makes two passes over the chunks (absmax, then quantize) instead of holding all of
y = WHT(a x) in registers. Divisions and square roots use the round-to-nearest intrinsics
(`div_rn`, `sqrt_rn`), as the reference's XLA ops do; NaN-propagating max/min mirror jnp.

`triton` and `jax_triton` are imported on first use only, so CPU installs never need them
(`pip install 'taco_jax[gpu]'` brings them). FP8 E4M3 needs compute capability >= 8.9.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec import constants as C
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.hadamard import hadamard
from taco_jax.kernels._tiles import wht_chunk

_BLOCK = 16  # groups per program (tl.dot needs >= 16 rows)
#: The spec constants, passed to the kernels as `tl.constexpr` arguments (a @triton.jit function
#: cannot read a module-level float).
_SPEC = dict(EPS=C.EPS, A_MIN=C.ADAPTIVE_SCALE_MIN, A_MAX=C.ADAPTIVE_SCALE_MAX, S_MAX=C.SCALE_MAX)


@functools.cache
def _kernels():
    """Builds the Triton kernels (first use only: imports triton)."""
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def encode_kernel(
        x_ptr,
        h_ptr,
        codes_ptr,
        s_ptr,
        a_ptr,
        N: tl.constexpr,
        G: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        N_GROUPS: tl.constexpr,
        LAST_COUNT: tl.constexpr,
        LAM: tl.constexpr,
        FMAX: tl.constexpr,
        R: tl.constexpr,
        SQRT_G: tl.constexpr,
        E4M3: tl.constexpr,
        EPS: tl.constexpr,
        A_MIN: tl.constexpr,
        A_MAX: tl.constexpr,
        S_MAX: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < N
        cols = tl.arange(0, G)
        x = tl.load(x_ptr + rows[:, None] * G + cols[None, :], mask=rmask[:, None], other=0.0)
        count = tl.where(rows % N_GROUPS == N_GROUPS - 1, LAST_COUNT, G).to(tl.float32)
        m = tl.div_rn(tl.sum(x * x, axis=1), count)
        v = tl.maximum(m + LAM, EPS, propagate_nan=tl.PropagateNan.ALL)
        a = tl.div_rn(tl.full((BLOCK,), FMAX, tl.float32), tl.sqrt_rn(v))
        a = tl.maximum(a, A_MIN, propagate_nan=tl.PropagateNan.ALL)
        a = tl.minimum(a, A_MAX, propagate_nan=tl.PropagateNan.ALL)
        xa = x * a[:, None]
        ccols = tl.arange(0, CHUNK)
        amax = tl.zeros((BLOCK,), tl.float32)
        for c in range(G // CHUNK):
            h = tl.load(h_ptr + cols[:, None] * G + (c * CHUNK + ccols)[None, :])
            y = tl.div_rn(tl.dot(xa, h, input_precision="ieee"), tl.full((BLOCK, CHUNK), SQRT_G, tl.float32))
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        s = tl.div_rn(tl.maximum(amax, EPS), tl.full((BLOCK,), R, tl.float32))
        s = tl.minimum(tl.maximum(s, EPS), S_MAX)
        n_bad = tl.sum(tl.where(tl.abs(x) < float("inf"), 0.0, 1.0), axis=1)
        s = tl.where(n_bad == 0, s, float("nan"))
        for c in range(G // CHUNK):
            h = tl.load(h_ptr + cols[:, None] * G + (c * CHUNK + ccols)[None, :])
            y = tl.div_rn(tl.dot(xa, h, input_precision="ieee"), tl.full((BLOCK, CHUNK), SQRT_G, tl.float32))
            q = tl.div_rn(y, tl.broadcast_to(s[:, None], (BLOCK, CHUNK)))
            q = tl.minimum(tl.maximum(q, -R, propagate_nan=tl.PropagateNan.ALL), R, propagate_nan=tl.PropagateNan.ALL)
            if E4M3:
                qc = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            else:
                qc = q.to(tl.float8e5, fp_downcast_rounding="rtne")
            tl.store(codes_ptr + rows[:, None] * G + (c * CHUNK + ccols)[None, :], qc, mask=rmask[:, None])
        tl.store(s_ptr + rows, s, mask=rmask)
        tl.store(a_ptr + rows, a, mask=rmask)

    @triton.jit
    def decode_kernel(
        codes_ptr,
        s_ptr,
        a_ptr,
        h_ptr,
        out_ptr,
        N: tl.constexpr,
        G: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
        HAS_A: tl.constexpr,
        SQRT_G: tl.constexpr,
        EPS: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < N
        cols = tl.arange(0, G)
        q = tl.load(codes_ptr + rows[:, None] * G + cols[None, :], mask=rmask[:, None], other=0.0)
        s = tl.load(s_ptr + rows, mask=rmask, other=1.0)
        y = q.to(tl.float32) * s[:, None]
        if HAS_A:
            den = tl.maximum(tl.load(a_ptr + rows, mask=rmask, other=1.0), EPS, propagate_nan=tl.PropagateNan.ALL)
        ccols = tl.arange(0, CHUNK)
        for c in range(G // CHUNK):
            h = tl.load(h_ptr + cols[:, None] * G + (c * CHUNK + ccols)[None, :])
            x = tl.div_rn(tl.dot(y, h, input_precision="ieee"), tl.full((BLOCK, CHUNK), SQRT_G, tl.float32))
            if HAS_A:
                x = tl.div_rn(x, tl.broadcast_to(den[:, None], (BLOCK, CHUNK)))
            tl.store(out_ptr + rows[:, None] * G + (c * CHUNK + ccols)[None, :], x, mask=rmask[:, None])

    return encode_kernel, decode_kernel


def encode_meta(cfg: CodecConfig, n: int, n_groups: int, last_count: int) -> dict:
    """`encode_kernel`'s constexpr arguments for `n` groups of `cfg.group_size` (grid: cdiv(n, BLOCK)).

    Shared by `encode_groups` and direct launches (the Triton interpreter test, AOT compiles)."""
    g = cfg.group_size
    return dict(
        N=n,
        G=g,
        BLOCK=_BLOCK,
        CHUNK=wht_chunk(g),
        N_GROUPS=n_groups,
        LAST_COUNT=int(last_count),
        LAM=float(np.float32(cfg.lam)),
        FMAX=float(cfg.fmax),
        R=float(np.float32(cfg.target_range)),
        SQRT_G=float(np.float32(math.sqrt(g))),
        E4M3=cfg.fmt == "e4m3",
        **_SPEC,
    )


def decode_meta(n: int, g: int, *, has_a: bool) -> dict:
    """`decode_kernel`'s constexpr arguments for `n` groups of size `g` (grid: cdiv(n, BLOCK))."""
    return dict(N=n, G=g, BLOCK=_BLOCK, CHUNK=wht_chunk(g), HAS_A=has_a, SQRT_G=float(np.float32(math.sqrt(g))),
                EPS=C.EPS)


def _triton_call(*args, kernel, out, grid, name, **meta):
    """`jax_triton.triton_call` across its API change (`out_shape` in 0.3.x, later `out_type`)."""
    import jax_triton as jt  # noqa: PLC0415

    params = inspect.signature(jt.triton_call).parameters
    key = "out_shape" if "out_shape" in params else "out_type"
    extra = {"name": name} if "name" in params else {}
    return jt.triton_call(*args, kernel=kernel, grid=grid, num_warps=4, num_stages=1, **{key: out}, **extra, **meta)


@functools.partial(jax.jit, static_argnames=("cfg", "last_count"))
def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int):
    """Fused encode, same contract as `taco_jax.codec.reference.encode_groups`."""
    *lead, n_groups, g = xg.shape
    encode_kernel, _ = _kernels()
    x2 = xg.astype(jnp.float32).reshape(-1, g)
    n = x2.shape[0]
    out = (
        jax.ShapeDtypeStruct((n, g), cfg.code_dtype),
        jax.ShapeDtypeStruct((n,), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    codes, s, a = _triton_call(
        x2,
        jnp.asarray(hadamard(g)),
        kernel=encode_kernel,
        out=out,
        grid=(pl_cdiv(n, _BLOCK),),
        name="taco_triton_encode",
        **encode_meta(cfg, n, n_groups, last_count),
    )
    return codes.reshape(*lead, n_groups, g), s.reshape(*lead, n_groups), a.reshape(*lead, n_groups)


@jax.jit
def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None) -> jax.Array:
    """Fused decode, same contract as `taco_jax.codec.reference.decode_groups`."""
    *lead, n_groups, g = codes.shape
    _, decode_kernel = _kernels()
    c2 = codes.reshape(-1, g)
    n = c2.shape[0]
    s1 = s.astype(jnp.float32).reshape(-1)
    a1 = s1 if a is None else a.astype(jnp.float32).reshape(-1)  # unread when HAS_A is False
    out = _triton_call(
        c2,
        s1,
        a1,
        jnp.asarray(hadamard(g)),
        kernel=decode_kernel,
        out=jax.ShapeDtypeStruct((n, g), jnp.float32),
        grid=(pl_cdiv(n, _BLOCK),),
        name="taco_triton_decode",
        **decode_meta(n, g, has_a=a is not None),
    )
    return out.reshape(*lead, n_groups, g)


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)
