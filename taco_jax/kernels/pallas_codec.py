"""Pallas fused TACO codec (spec §2): one program per block of groups; Triton on GPU, interpreter on CPU.

Each program reads a [block, G] tile in the message's own dtype (`NATIVE_DTYPES`) once: sum of squares -> a -> WHT
as an in-register butterfly (`_wht`, log2(G) stages) -> absmax -> s -> FP8 codes; decode: q s / (sqrt(G) max(a,
EPS)) -> the same butterfly -> the output dtype (clipped); decode-sum: P ranks in float32 in rank order, rounded
once. The reference's arithmetic up to the order of the transform's sums (conformance rule in `taco_jax.kernels`).

The mode follows the platform lowered for (`lax.platform_dependent`), so a CUDA `jax.export` works
on a CPU host: CPU lowers the interpreter (slow: for tests), CUDA the Triton kernel (FP8 E4M3
needs sm >= 89). `lowering_platform("cuda")` pins it while tracing (needed inside `shard_map`)."""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from taco_jax.codec import constants as C
from taco_jax.codec.backends import PINNED, pin_platform, pinned_platform, register_pin_hook  # noqa: F401 (public here)
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.vma import pvary, shape_dtype, vma_of

#: Message dtypes the kernels read and write as they are (no convert around the kernel).
NATIVE_DTYPES = ("float32", "bfloat16", "float16")
#: Elements per program by default (groups per program = ELEMENTS // G): 16 float32 registers per
#: thread at 4 warps, as `triton_codec`.
ELEMENTS = 2048


_GPU_LOWERINGS = ("triton", "mosaic_gpu")


@contextlib.contextmanager
def lowering_platform(platform: str, gpu_lowering: str = "triton"):
    """Traces the kernels (and resolves backends) for `platform` ("cpu": interpreter, "cuda":
    `gpu_lowering`, Pallas' "triton" or "mosaic_gpu") instead of per lowering platform, for
    `jax.export(..., platforms=[platform])` from another host. The kernels' jit caches are cleared
    on entry and exit; jit'd callers traced inside must not run here.
    Raises: ValueError for a platform other than "cpu", "cuda", "rocm", or an unknown gpu_lowering."""
    if platform not in ("cpu", "cuda", "rocm"):
        raise ValueError(f"{platform=} must be 'cpu', 'cuda' or 'rocm'")
    if gpu_lowering not in _GPU_LOWERINGS:
        raise ValueError(f"{gpu_lowering=} must be one of {_GPU_LOWERINGS}")
    with pin_platform(platform, gpu_lowering):
        yield


def _clear_caches():
    for fn in (encode_groups, decode_groups, decode_sum_groups):
        fn.clear_cache()


def _gpu_compiler_params(gpu_lowering: str):
    if gpu_lowering == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plmgpu  # noqa: PLC0415

        return plmgpu.CompilerParams()
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _per_platform(call, *args, vma: frozenset):
    """`call(*args, interpret=..., compiler_params=...)` in the mode of the platform lowered for:
    Triton on CUDA; on CPU plain `interpret=True`, or the TPU-semantics interpreter for operands
    varying over manual axes (only it handles `shard_map(check_vma=True)`; its ordered callbacks
    stop `platform_dependent` lowering for CUDA alone, hence `lowering_platform`)."""
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


# --- Kernels


def _wht(x):
    """Unnormalised Sylvester-order WHT of each row of x [B, G] float32: stage j pairs the indices
    differing in bit j (lo: bit clear, hi: bit set) and writes lo + hi, lo - hi in place."""
    b, g = x.shape
    for j in range(g.bit_length() - 1):
        lo, hi = jax.lax.unstack(x.reshape(b, g // (2 << j), 2, 1 << j).transpose(0, 1, 3, 2), axis=3)
        x = jax.lax.stack([lo + hi, lo - hi], axis=3).transpose(0, 1, 3, 2).reshape(b, g)
    return x


def _encode_kernel(x_ref, codes_ref, s_ref, a_ref, *, block, g, n_groups, last_count, lam, fmax, r):
    x = x_ref[...].astype(jnp.float32)  # [block, G]
    row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    count = jnp.where(row % n_groups == n_groups - 1, np.float32(last_count), np.float32(g))
    # 1-2. mean square over the real elements, adaptive scale
    m = jnp.sum(x * x, axis=1) / count
    v = jnp.maximum(m + np.float32(lam), np.float32(C.EPS))
    a = jnp.clip(np.float32(fmax) / jnp.sqrt(v), np.float32(C.ADAPTIVE_SCALE_MIN), np.float32(C.ADAPTIVE_SCALE_MAX))
    # NaN in -> NaN a, as the reference: Triton lowers maximum/clip to fmax/fmin, which drop NaN
    a = jnp.where(jnp.isnan(m), np.float32(np.nan), a)
    n_bad = jnp.sum(jnp.where(jnp.abs(x) < np.float32(np.inf), 0.0, 1.0), axis=1)
    # 3. t = WHT(a x), once; y = t / sqrt(G) is never formed: max|y| = max|t| / sqrt(G)
    sqrt_g = np.float32(math.sqrt(g))
    t = _wht(a[:, None] * x)
    amax = jnp.max(jnp.abs(t), axis=1) / sqrt_g
    # 4. quantization scale; a group holding NaN/Inf gets s = NaN
    s = jnp.clip(jnp.maximum(amax, np.float32(C.EPS)) / np.float32(r), np.float32(C.EPS), np.float32(C.SCALE_MAX))
    s = jnp.where(n_bad == 0, s, np.float32(np.nan))
    # 5. codes q = y / s = t * (1 / (sqrt(G) s)), RNE, saturated by the clip
    k = np.float32(1) / (s * sqrt_g)
    codes_ref[...] = jnp.clip(t * k[:, None], -np.float32(r), np.float32(r)).astype(codes_ref.dtype)
    s_ref[...] = s
    a_ref[...] = a


def _decode_block(codes, s, a, g):
    """x' = WHT(fp8(q) s) / sqrt(G) / max(a, EPS) of codes [B, G] (a None: folded), float32 [B, G]."""
    k = s / np.float32(math.sqrt(g))
    if a is not None:
        k = k / jnp.maximum(a, np.float32(C.EPS))
    return _wht(codes.astype(jnp.float32) * k[:, None])


def _store_out(out_ref, x, clip: bool = True):
    """x float32 clipped to out_ref's finite range when narrower and `clip` (NaN kept: Triton's fmin /
    fmax drop it) and stored in its dtype."""
    if clip and jnp.finfo(out_ref.dtype).max < jnp.finfo(jnp.float32).max:
        big = np.float32(jnp.finfo(out_ref.dtype).max)
        x = jnp.where(jnp.isnan(x), x, jnp.clip(x, -big, big))
    out_ref[...] = x.astype(out_ref.dtype)


def _decode_kernel(codes_ref, s_ref, *rest, g, has_a):
    a_ref, out_ref = rest if has_a else (None, rest[0])
    _store_out(out_ref, _decode_block(codes_ref[...], s_ref[...], a_ref[...] if has_a else None, g))


def _decode_sum_kernel(codes_ref, s_ref, *rest, g, has_a, p):
    a_ref, out_ref = rest if has_a else (None, rest[0])
    acc = _decode_block(codes_ref[0], s_ref[0], a_ref[0] if has_a else None, g)
    for r in range(1, p):  # rank order, float32
        acc = acc + _decode_block(codes_ref[r], s_ref[r], a_ref[r] if has_a else None, g)
    _store_out(out_ref, acc, clip=False)  # the sum rounded once, as the exact sum: ±Inf where it overflows


# --- Public ops


def _pad_rows(x, block, axis=0):
    n = x.shape[axis]
    pad = -n % block
    if not pad:
        return x, n
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths), n


def _block_rows(n: int, g: int, block: int | None) -> int:
    """Rows per program: `block` (default ELEMENTS // g), or less for small inputs (a power of 2).
    Raises ValueError for a block that is not a power of 2."""
    block = block or max(1, ELEMENTS // g)
    if block < 1 or block & (block - 1):
        raise ValueError(f"{block=} must be a power of 2")
    return min(block, 1 << max(0, (n - 1).bit_length()))


def _check_dtype(dtype, what: str):
    if jnp.dtype(dtype).name not in NATIVE_DTYPES:
        raise ValueError(f"{what} dtype {jnp.dtype(dtype).name} is not one of {NATIVE_DTYPES}")


@functools.partial(jax.jit, static_argnames=("cfg", "last_count", "block"))
def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int, block: int | None = None):
    """Fused encode, the contract of `taco_jax.codec.reference.encode_groups`, reading `xg` (float32,
    bfloat16 or float16) in its own dtype. block: groups per program (a power of 2; default
    ELEMENTS // G). Raises: ValueError for another dtype or a block that is not a power of 2."""
    *lead, n_groups, g = xg.shape
    _check_dtype(xg.dtype, "encode input")
    x2 = xg.reshape(-1, g)
    bn = _block_rows(x2.shape[0], g, block)
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

    def call(x2, *, interpret, compiler_params):
        return pl.pallas_call(
            kernel,
            out_shape=(
                shape_dtype((n_pad, g), cfg.code_dtype, vma),
                shape_dtype((n_pad,), jnp.float32, vma),
                shape_dtype((n_pad,), jnp.float32, vma),
            ),
            grid=(n_pad // bn,),
            in_specs=[pl.BlockSpec((bn, g), lambda i: (i, 0))],
            out_specs=(
                pl.BlockSpec((bn, g), lambda i: (i, 0)),
                pl.BlockSpec((bn,), lambda i: (i,)),
                pl.BlockSpec((bn,), lambda i: (i,)),
            ),
            interpret=interpret,
            compiler_params=compiler_params,
            name="taco_encode_groups",
        )(x2)

    codes, s, a = _per_platform(call, x2, vma=vma)
    codes, s, a = codes[:n], s[:n], a[:n]
    return codes.reshape(*lead, n_groups, g), s.reshape(*lead, n_groups), a.reshape(*lead, n_groups)


def _decode_call(codes, s, a, *, dtype, block, p):
    """decode (p None: codes [n, G]) or decode-sum (codes [p, n, G]) -> dtype [n, G]."""
    g = codes.shape[-1]
    n = codes.shape[-2]
    bn = _block_rows(n, g, block)
    lead = () if p is None else (p,)
    axis = len(lead)
    c2, _ = _pad_rows(codes, bn, axis)
    n_pad = c2.shape[axis]
    args = [c2, _pad_rows(s.astype(jnp.float32), bn, axis)[0]]
    spec = (lambda i: (i, 0)) if p is None else (lambda i: (0, i, 0))
    vspec = (lambda i: (i,)) if p is None else (lambda i: (0, i))
    specs = [pl.BlockSpec((*lead, bn, g), spec), pl.BlockSpec((*lead, bn), vspec)]
    if a is not None:
        args.append(_pad_rows(a.astype(jnp.float32), bn, axis)[0])
        specs.append(pl.BlockSpec((*lead, bn), vspec))
    vma = frozenset().union(*(vma_of(t) for t in args))
    args = [pvary(t, vma) for t in args]
    if p is None:
        kernel = functools.partial(_decode_kernel, g=g, has_a=a is not None)
    else:
        kernel = functools.partial(_decode_sum_kernel, g=g, has_a=a is not None, p=p)

    def call(*operands, interpret, compiler_params):
        return pl.pallas_call(
            kernel,
            out_shape=shape_dtype((n_pad, g), dtype, vma),
            grid=(n_pad // bn,),
            in_specs=specs,
            out_specs=pl.BlockSpec((bn, g), lambda i: (i, 0)),
            interpret=interpret,
            compiler_params=compiler_params,
            name="taco_decode_groups" if p is None else "taco_decode_sum_groups",
        )(*operands)

    return _per_platform(call, *args, vma=vma)[:n]


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, *, block: int | None = None,
                  dtype=jnp.float32) -> jax.Array:
    """Fused decode, same contract as `taco_jax.codec.reference.decode_groups`, written straight in
    `dtype` (float32, bfloat16 or float16; finite values clipped to its range first, as
    `taco_jax.codec.dispatch.clip_to_dtype`). Returns dtype [..., n_groups, G].
    Raises: ValueError for another dtype or a block that is not a power of 2."""
    *lead, n_groups, g = codes.shape
    _check_dtype(dtype, "decode output")
    a1 = None if a is None else a.reshape(-1)
    out = _decode_call(codes.reshape(-1, g), s.reshape(-1), a1, dtype=dtype, block=block, p=None)
    return out.reshape(*lead, n_groups, g)


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def decode_sum_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, *, block: int | None = None,
                      dtype=jnp.float32) -> jax.Array:
    """The group backend's `decode_sum_groups` (contract in `taco_jax.codec.backends`).
    Raises: ValueError for another dtype or a block that is not a power of 2."""
    p, *lead, n_groups, g = codes.shape
    _check_dtype(dtype, "decode output")
    a1 = None if a is None else a.reshape(p, -1)
    out = _decode_call(codes.reshape(p, -1, g), s.reshape(p, -1), a1, dtype=dtype, block=block, p=p)
    return out.reshape(*lead, n_groups, g)


register_pin_hook(_clear_caches)  # `codec.backends.pin_platform` from above the kernels clears them too
