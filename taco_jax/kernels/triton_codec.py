"""Triton fused TACO codec (spec §2) called through jax-triton; GPU only, imported lazily.

One program per block of `ELEMENTS // G` groups, each element read from HBM once and written once;
the same passes as `pallas_codec` (encode, decode, decode_sum), the WHT an in-register butterfly
(`_wht`). Per-group divisions and square roots round to nearest (`div_rn`, `sqrt_rn`) as the
reference's XLA ops do, so the kernels conform under the rule of `taco_jax.kernels`.

`triton` and `jax_triton` are imported on first use (`pip install 'taco_jax[gpu]'`). FP8 E4M3 needs
sm >= 89. jax-triton types its results invariant inside `shard_map`, so the wrappers restore the
operands' varying axes (`codec.vma.pvary`). Without a GPU (a deviceless compile) the cubin is built
for the capability of the devices lowered for (`_lowering_capability`)."""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec import constants as C
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.vma import pvary, vma_of

#: Message dtypes the kernels read and write as they are (no convert around the custom call).
NATIVE_DTYPES = ("float32", "bfloat16", "float16")
#: Elements per program (groups per program = ELEMENTS // G): 16 f32 values per thread at 4 warps
#: (register counts: `python -m experiments.gpu.triton_aot`).
ELEMENTS = 2048
NUM_WARPS = 4
#: The spec constants, passed to the kernels as `tl.constexpr` arguments (a @triton.jit function
#: cannot read a module-level float).
_SPEC = dict(EPS=C.EPS, A_MIN=C.ADAPTIVE_SCALE_MIN, A_MAX=C.ADAPTIVE_SCALE_MAX, S_MAX=C.SCALE_MAX)


def block_groups(g: int) -> int:
    """Groups per program for group size `g`."""
    return max(1, ELEMENTS // g)


def clip_value(dtype) -> float:
    """Largest finite value of output `dtype` when narrower than float32 (decoded values are clipped
    to it, as `taco_jax.codec.dispatch.clip_to_dtype`), else 0.0 (no clip)."""
    dtype = jnp.dtype(dtype)
    return float(jnp.finfo(dtype).max) if jnp.finfo(dtype).max < jnp.finfo(jnp.float32).max else 0.0


@functools.cache
def _kernels():
    """The Triton kernels (encode, decode, decode_sum); first use only: imports triton."""
    from taco_jax.kernels import _triton_kernels as k  # noqa: PLC0415

    return k.encode_kernel, k.decode_kernel, k.decode_sum_kernel


def encode_meta(cfg: CodecConfig, n: int, n_groups: int, last_count: int) -> dict:
    """`encode_kernel`'s constexpr arguments for `n` groups of `cfg.group_size` (grid:
    cdiv(n, BLOCK)). Shared by `encode_groups` and direct launches (the Triton interpreter test, AOT compiles)."""
    g = cfg.group_size
    return dict(
        N=n,
        G=g,
        LOG_G=g.bit_length() - 1,
        BLOCK=block_groups(g),
        N_GROUPS=n_groups,
        LAST_COUNT=int(last_count),
        LAM=float(np.float32(cfg.lam)),
        FMAX=float(cfg.fmax),
        R=float(np.float32(cfg.target_range)),
        SQRT_G=float(np.float32(math.sqrt(g))),
        E4M3=cfg.fmt == "e4m3",
        CLAMP=bool(np.float32(cfg.target_range) < cfg.fmax),  # else cvt.rn.satfinite saturates to +-R
        **_SPEC,
    )


def decode_meta(n: int, g: int, *, has_a: bool, dtype=jnp.float32, p: int | None = None) -> dict:
    """`decode_kernel`'s constexpr arguments for `n` groups of size `g` written in `dtype` (grid:
    cdiv(n, BLOCK)); with `p`, `decode_sum_kernel`'s for `p` ranks' codes of those groups (the sum
    is not clipped: CLIP 0)."""
    meta = dict(N=n, G=g, LOG_G=g.bit_length() - 1, BLOCK=block_groups(g), HAS_A=has_a,
                SQRT_G=float(np.float32(math.sqrt(g))), EPS=C.EPS, CLIP=clip_value(dtype) if p is None else 0.0)
    if p is not None:
        meta["P"] = p
    return meta


def _capability_of(devices) -> int | None:
    """The compute capability of the first of `devices` as jax-triton spells it (major * 10 + minor,
    e.g. 90), or None when there is none or it carries no `compute_capability` (a CPU device)."""
    try:
        first = next(iter(devices), None)
        major, minor = str(getattr(first, "compute_capability", "")).split(".")
        return int(major) * 10 + int(minor)
    except (TypeError, ValueError):
        return None


def _lowering_capability(ctx) -> int | None:
    """The compute capability of the devices a computation is being lowered for (`_capability_of`),
    read from the lowering's axis context: the device assignment of a jit, or the mesh of a
    `shard_map`; None when they are not known there (an abstract mesh)."""
    axis = ctx.module_context.axis_context
    devices = getattr(axis, "device_assignment", None)
    if devices is None:
        mesh = getattr(axis, "mesh", None)
        try:
            devices = None if mesh is None else np.asarray(mesh.devices).flat
        except (AttributeError, ValueError, TypeError):  # an abstract mesh has no devices
            devices = None
    return None if devices is None else _capability_of(devices)


@functools.cache
def _jax_triton():
    """`jax_triton`, imported on first use, its CUDA lowering wrapped once so that a call naming no
    compute capability compiles for the devices lowered for (`_lowering_capability`), not for this
    process's device 0 (absent without a GPU); otherwise jax-triton's own rule."""
    import jax_triton as jt  # noqa: PLC0415

    lib = getattr(jt, "triton_lib", None)
    names = ("triton_kernel_call_p", "triton_kernel_call_lowering", "get_cuda_backend")
    if lib is not None and all(hasattr(lib, n) for n in names):  # jax-triton >= 0.3.1; else its own rule
        from jax.interpreters import mlir  # noqa: PLC0415

        def lowering(ctx, *args, compute_capability=None, **params):
            if compute_capability is None:
                compute_capability = _lowering_capability(ctx)
            return lib.triton_kernel_call_lowering(lib.get_cuda_backend, ctx, *args,
                                                   compute_capability=compute_capability, **params)

        mlir.register_lowering(lib.triton_kernel_call_p, lowering, platform="cuda")
    return jt


def _triton_call(*args, kernel, out, grid, name, **meta):
    """`jax_triton.triton_call` across its API change (`out_shape` in 0.3.x, later `out_type`), its array operands
    made to vary over the same manual axes and its results given those axes (the module docstring)."""
    jt = _jax_triton()
    vma = frozenset().union(*(vma_of(a) for a in args))
    args = [pvary(a, vma) for a in args]
    params = inspect.signature(jt.triton_call).parameters
    key = "out_shape" if "out_shape" in params else "out_type"
    extra = {"name": name} if "name" in params else {}
    outs = jt.triton_call(*args, kernel=kernel, grid=grid, num_warps=NUM_WARPS, num_stages=1, **{key: out}, **extra,
                          **meta)
    return jax.tree.map(lambda o: pvary(o, vma), outs)


def _check_dtype(dtype, what: str):
    if jnp.dtype(dtype).name not in NATIVE_DTYPES:
        raise ValueError(f"{what} dtype {jnp.dtype(dtype).name} is not one of {NATIVE_DTYPES}")


@functools.partial(jax.jit, static_argnames=("cfg", "last_count"))
def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int):
    """Fused encode, the contract of `taco_jax.codec.reference.encode_groups`, reading `xg` in its own
    dtype (`NATIVE_DTYPES`). Raises: ValueError for another dtype."""
    *lead, n_groups, g = xg.shape
    _check_dtype(xg.dtype, "encode input")
    encode_kernel = _kernels()[0]
    x2 = xg.reshape(-1, g)
    n = x2.shape[0]
    out = (
        jax.ShapeDtypeStruct((n, g), cfg.code_dtype),
        jax.ShapeDtypeStruct((n,), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    codes, s, a = _triton_call(x2, kernel=encode_kernel, out=out, grid=(cdiv(n, block_groups(g)),),
                               name="taco_triton_encode", **encode_meta(cfg, n, n_groups, last_count))
    return codes.reshape(*lead, n_groups, g), s.reshape(*lead, n_groups), a.reshape(*lead, n_groups)


@functools.partial(jax.jit, static_argnames=("dtype",))
def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, *, dtype=jnp.float32) -> jax.Array:
    """Fused decode, the contract of `taco_jax.codec.reference.decode_groups`, written straight in
    `dtype` (float32, bfloat16 or float16; finite values clipped to its range first, as
    `taco_jax.codec.dispatch.clip_to_dtype`). Returns dtype [..., n_groups, G].
    Raises: ValueError for another dtype."""
    *lead, n_groups, g = codes.shape
    _check_dtype(dtype, "decode output")
    decode_kernel = _kernels()[1]
    c2 = codes.reshape(-1, g)
    n = c2.shape[0]
    s1 = s.astype(jnp.float32).reshape(-1)
    a1 = s1 if a is None else a.astype(jnp.float32).reshape(-1)  # unread when HAS_A is False
    out = _triton_call(c2, s1, a1, kernel=decode_kernel, out=jax.ShapeDtypeStruct((n, g), dtype),
                       grid=(cdiv(n, block_groups(g)),), name="taco_triton_decode",
                       **decode_meta(n, g, has_a=a is not None, dtype=dtype))
    return out.reshape(*lead, n_groups, g)


@functools.partial(jax.jit, static_argnames=("dtype",))
def decode_sum_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, *, dtype=jnp.float32) -> jax.Array:
    """The group backend's `decode_sum_groups` (contract in `taco_jax.codec.backends`).
    Raises: ValueError for another dtype."""
    p, *lead, n_groups, g = codes.shape
    _check_dtype(dtype, "decode output")
    kernel = _kernels()[2]
    n = math.prod(lead) * n_groups
    c2 = codes.reshape(p, n, g)
    s1 = s.astype(jnp.float32).reshape(p, n)
    a1 = s1 if a is None else a.astype(jnp.float32).reshape(p, n)
    out = _triton_call(c2, s1, a1, kernel=kernel, out=jax.ShapeDtypeStruct((n, g), dtype),
                       grid=(cdiv(n, block_groups(g)),), name="taco_triton_decode_sum",
                       **decode_meta(n, g, has_a=a is not None, dtype=dtype, p=p))
    return out.reshape(*lead, n_groups, g)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)
