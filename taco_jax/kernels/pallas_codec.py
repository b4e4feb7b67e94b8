"""Pallas fused TACO codec (spec §2): one program per block of groups; Triton on GPU, interpreter on CPU.

Each program loads a [block, G] tile of groups and does the whole group math in one pass:
sum of squares -> adaptive scale a -> Walsh-Hadamard transform as a matmul with the ±1
Sylvester matrix (in column chunks, so the operand tiles stay small on GPU) -> absmax ->
quantization scale s -> FP8 codes; decode is FP8 -> x s -> the same matmul -> / (sqrt(G) a).
The arithmetic is the reference's (`taco_jax.codec.reference`), op for op; only the matmul's
summation order may differ (see the conformance rule in `taco_jax.kernels`).

Interpret mode is chosen by the platform the computation is *lowered* for
(`lax.platform_dependent`), not the one jax runs on, so `jax.export(..., platforms=["cuda"])`
works on a CPU-only machine: CPU lowers the Pallas interpreter (`interpret=True`; slow: for
tests, not training), CUDA the Triton kernel (FP8 E4M3 casts need compute capability >= 8.9).
`lowering_platform("cuda")` pins the mode while tracing (needed for calls inside
`shard_map(check_vma=True)`, where `platform_dependent` cannot lower for CUDA alone; see
`_per_platform`), e.g. to export a whole training step (tests/test_gpu_export.py).

Layout: in the order of jax's `experimental/pallas/ops`: kernels, then the public ops.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from taco_jax.codec import constants as C
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.hadamard import hadamard
from taco_jax.codec.vma import pvary, shape_dtype, vma_of
from taco_jax.kernels._platform import PINNED, pinned_platform  # noqa: F401  (pinned_platform: public here)
from taco_jax.kernels._tiles import wht_chunk

_HIGHEST = jax.lax.Precision.HIGHEST


_GPU_LOWERINGS = ("triton", "mosaic_gpu")


@contextlib.contextmanager
def lowering_platform(platform: str, gpu_lowering: str = "triton"):
    """Traces the kernels for `platform` ("cpu": interpreter, "cuda": `gpu_lowering`) instead of
    choosing per lowering platform; `gpu_lowering` is Pallas' "triton" (the default) or "mosaic_gpu".

    For `jax.export(..., platforms=[platform])` from another host, e.g. a CUDA export of a whole
    training step on a CPU-only machine. Traces made inside are for that platform only, so the
    kernels' jit caches are cleared on entry and exit; jit'd callers traced inside must not run here.
    Inside, `taco_jax.kernels` resolves backends for `platform` too (e.g. pallas is allowed in a
    multi-device program traced for CUDA).

    Raises: ValueError for a platform other than "cpu", "cuda", "rocm", or an unknown gpu_lowering.
    """
    if platform not in ("cpu", "cuda", "rocm"):
        raise ValueError(f"{platform=} must be 'cpu', 'cuda' or 'rocm'")
    if gpu_lowering not in _GPU_LOWERINGS:
        raise ValueError(f"{gpu_lowering=} must be one of {_GPU_LOWERINGS}")
    encode_groups.clear_cache()
    decode_groups.clear_cache()
    token = PINNED.set((platform, gpu_lowering))
    try:
        yield
    finally:
        PINNED.reset(token)
        encode_groups.clear_cache()
        decode_groups.clear_cache()


def _gpu_compiler_params(gpu_lowering: str):
    if gpu_lowering == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plmgpu  # noqa: PLC0415

        return plmgpu.CompilerParams()
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _per_platform(call, *args, vma: frozenset):
    """`call(*args, interpret=..., compiler_params=...)` in the mode of the platform the computation
    is lowered for (`lax.platform_dependent`): Triton on CUDA; on CPU the interpreter, plain
    `interpret=True` (no host callbacks) outside `shard_map`, and the TPU-semantics one for operands
    varying over manual axes (`vma`), as only it handles them under `shard_map(check_vma=True)`.
    Inside `lowering_platform(...)` the pinned platform's mode is used directly.

    Limitation (jax 0.10.2): the TPU-semantics interpreter has ordered host callbacks, and
    `platform_dependent` then fails to lower for CUDA alone ("incorrect set of output tokens"), so
    a CUDA `jax.export` from a CPU host of calls inside `shard_map(check_vma=True)` needs
    `lowering_platform("cuda")`.
    """
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

    cpu_mode = pltpu.InterpretParams() if vma else True
    pinned = PINNED.get()
    if pinned is not None:
        platform, gpu_lowering = pinned
        if platform == "cpu":
            return call(*args, interpret=cpu_mode, compiler_params=None)
        return call(*args, interpret=False, compiler_params=_gpu_compiler_params(gpu_lowering))
    return jax.lax.platform_dependent(
        *args,
        cpu=functools.partial(call, interpret=cpu_mode, compiler_params=None),
        cuda=functools.partial(call, interpret=False, compiler_params=_gpu_compiler_params("triton")),
    )


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


def _encode_kernel(x_ref, h_ref, codes_ref, s_ref, a_ref, *, block, g, n_groups, last_count, lam, fmax, r):
    x = x_ref[...]  # [block, G] f32
    row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    count = jnp.where(row % n_groups == n_groups - 1, np.float32(last_count), np.float32(g))
    # 1-2. mean square over the real elements, adaptive scale
    m = jnp.sum(x * x, axis=1) / count
    v = jnp.maximum(m + np.float32(lam), np.float32(C.EPS))
    a = jnp.clip(np.float32(fmax) / jnp.sqrt(v), np.float32(C.ADAPTIVE_SCALE_MIN), np.float32(C.ADAPTIVE_SCALE_MAX))
    # NaN in -> NaN a, as the reference: Triton lowers maximum/clip to fmax/fmin, which drop NaN
    # (seen on an H200: a NaN group got a = ADAPTIVE_SCALE_MAX)
    a = jnp.where(jnp.isnan(m), np.float32(np.nan), a)
    xa = a[:, None] * x
    # 3. y = WHT(a x) / sqrt(G), by column chunks of H (a loop, not unrolled: G = 512 would
    # otherwise make a huge Triton kernel); pass 1 takes the absmax, pass 2 recomputes y.
    c = wht_chunk(g)
    sqrt_g = np.float32(math.sqrt(g))

    def y_chunk(i):
        h = h_ref[:, pl.ds(pl.multiple_of(i * c, c), c)]
        return jnp.dot(xa, h, precision=(_HIGHEST, _HIGHEST), preferred_element_type=jnp.float32) / sqrt_g

    amax = jax.lax.fori_loop(
        0, g // c, lambda i, m: jnp.maximum(m, jnp.max(jnp.abs(y_chunk(i)), axis=1)), jnp.zeros((block,), jnp.float32)
    )
    # 4. quantization scale; a group holding NaN/Inf gets s = NaN
    s = jnp.clip(jnp.maximum(amax, np.float32(C.EPS)) / np.float32(r), np.float32(C.EPS), np.float32(C.SCALE_MAX))
    n_bad = jnp.sum(jnp.where(jnp.abs(x) < np.float32(np.inf), 0.0, 1.0), axis=1)
    s = jnp.where(n_bad == 0, s, np.float32(np.nan))

    # 5. codes (RNE, saturated by the clip)
    @pl.loop(0, g // c)
    def _(i):
        q = jnp.clip(y_chunk(i) / s[:, None], -np.float32(r), np.float32(r))
        codes_ref[:, pl.ds(pl.multiple_of(i * c, c), c)] = q.astype(codes_ref.dtype)

    s_ref[...] = s
    a_ref[...] = a


def _decode_kernel(codes_ref, s_ref, *rest, g, has_a):
    if has_a:
        a_ref, h_ref, out_ref = rest
    else:
        h_ref, out_ref = rest
    y = codes_ref[...].astype(jnp.float32) * s_ref[...][:, None]
    sqrt_g = np.float32(math.sqrt(g))
    if has_a:
        den = jnp.maximum(a_ref[...], np.float32(C.EPS))[:, None]
    c = wht_chunk(g)

    @pl.loop(0, g // c)
    def _(i):
        cols = pl.ds(pl.multiple_of(i * c, c), c)
        x = jnp.dot(y, h_ref[:, cols], precision=(_HIGHEST, _HIGHEST), preferred_element_type=jnp.float32)
        x = x / sqrt_g
        if has_a:
            x = x / den
        out_ref[:, cols] = x


# --------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------


def _pad_rows(x, block):
    n = x.shape[0]
    pad = -n % block
    return (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x), n


def _block_rows(n: int, block: int) -> int:
    """Rows per program: `block`, or less for small inputs (a power of 2, at least 16)."""
    return max(16, min(block, 1 << max(0, (n - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("cfg", "last_count", "block"))
def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int, block: int = 64):
    """Fused encode, same contract as `taco_jax.codec.reference.encode_groups`.

    Args:
      xg: float32 [..., n_groups, G]; cfg: codec config; last_count: real size of the last group.
      block: groups per program (a power of 2 >= 16).
    """
    *lead, n_groups, g = xg.shape
    if block < 16 or block & (block - 1):
        raise ValueError(f"{block=} must be a power of 2 >= 16")
    x2 = xg.astype(jnp.float32).reshape(-1, g)
    bn = _block_rows(x2.shape[0], block)
    x2, n = _pad_rows(x2, bn)
    n_pad = x2.shape[0]
    vma = vma_of(x2)
    kernel = functools.partial(
        _encode_kernel,
        block=bn,
        g=g,
        n_groups=n_groups,
        last_count=last_count,
        lam=cfg.lam,
        fmax=cfg.fmax,
        r=cfg.target_range,
    )
    h = pvary(jnp.asarray(hadamard(g)), vma)

    def call(x2, h, *, interpret, compiler_params):
        return pl.pallas_call(
            kernel,
            out_shape=(
                shape_dtype((n_pad, g), cfg.code_dtype, vma),
                shape_dtype((n_pad,), jnp.float32, vma),
                shape_dtype((n_pad,), jnp.float32, vma),
            ),
            grid=(n_pad // bn,),
            in_specs=[pl.BlockSpec((bn, g), lambda i: (i, 0)), pl.BlockSpec((g, g), lambda i: (0, 0))],
            out_specs=(
                pl.BlockSpec((bn, g), lambda i: (i, 0)),
                pl.BlockSpec((bn,), lambda i: (i,)),
                pl.BlockSpec((bn,), lambda i: (i,)),
            ),
            interpret=interpret,
            compiler_params=compiler_params,
            name="taco_encode_groups",
        )(x2, h)

    codes, s, a = _per_platform(call, x2, h, vma=vma)
    codes, s, a = codes[:n], s[:n], a[:n]
    return codes.reshape(*lead, n_groups, g), s.reshape(*lead, n_groups), a.reshape(*lead, n_groups)


@functools.partial(jax.jit, static_argnames=("block",))
def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, *, block: int = 64) -> jax.Array:
    """Fused decode, same contract as `taco_jax.codec.reference.decode_groups`."""
    *lead, n_groups, g = codes.shape
    if block < 16 or block & (block - 1):
        raise ValueError(f"{block=} must be a power of 2 >= 16")
    c2 = codes.reshape(-1, g)
    n = c2.shape[0]
    bn = _block_rows(n, block)
    c2, _ = _pad_rows(c2, bn)
    n_pad = c2.shape[0]
    args = [c2, _pad_rows(s.astype(jnp.float32).reshape(-1), bn)[0]]
    specs = [pl.BlockSpec((bn, g), lambda i: (i, 0)), pl.BlockSpec((bn,), lambda i: (i,))]
    if a is not None:
        args.append(_pad_rows(a.astype(jnp.float32).reshape(-1), bn)[0])
        specs.append(pl.BlockSpec((bn,), lambda i: (i,)))
    vma = frozenset().union(*(vma_of(t) for t in args))
    h = pvary(jnp.asarray(hadamard(g)), vma)
    args = [pvary(t, vma) for t in args]

    def call(*operands, interpret, compiler_params):
        return pl.pallas_call(
            functools.partial(_decode_kernel, g=g, has_a=a is not None),
            out_shape=shape_dtype((n_pad, g), jnp.float32, vma),
            grid=(n_pad // bn,),
            in_specs=specs + [pl.BlockSpec((g, g), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((bn, g), lambda i: (i, 0)),
            interpret=interpret,
            compiler_params=compiler_params,
            name="taco_decode_groups",
        )(*operands)

    out = _per_platform(call, *args, h, vma=vma)
    return out[:n].reshape(*lead, n_groups, g)
