"""XLA FFI codec backend: the fused C++ (CPU) and CUDA (GPU) handlers of `custom_calls/`.

The libraries in `taco_jax/kernels/_lib/` (`make -C custom_calls`, `... cuda`) are loaded on first use and registered
under the same target names per platform. Leading axes are flattened (also under `vmap`: `vmap_method="broadcast_all"`).
`NATIVE_DTYPES` are read and written as they are, bit-identical to converting through float32; other floating dtypes are
cast to float32. Each handler call raises RuntimeError when the platform's library is not built (`_ensure_loaded`)."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec.backends import default_platform
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.vma import pvary, vma_of

LIB_DIR = Path(os.environ.get("TACO_KERNELS_LIB_DIR", Path(__file__).parent / "_lib"))
LIBS = {"cpu": "libtaco_codec_cpu.so", "cuda": "libtaco_codec_cuda.so"}
BUILD_HINT = {
    "cpu": "build it with `make -C custom_calls` (C++17 compiler; headers from jax.ffi.include_dir())",
    "cuda": "build it with `make -C custom_calls cuda` (needs nvcc)",
}
_TARGETS = {  # FFI target name -> exported handler symbol (suffix Cpu / Cuda)
    "taco_encode": "TacoEncode",
    "taco_decode": "TacoDecode",
    "taco_fp8_cast": "TacoFp8Cast",
}
#: Targets only the CPU library has (on GPU the jnp reference runs; XLA fuses it).
_CPU_TARGETS = {
    "taco_reduce": "TacoReduce",
    # packed wire rows (`encode_packed` ...): the compressed collectives' fused path
    "taco_encode_packed": "TacoEncodePacked",
    "taco_decode_packed": "TacoDecodePacked",
    "taco_decode_sum_packed": "TacoDecodeSumPacked",
    "taco_reduce_packed": "TacoReducePacked",
    "taco_reduce_hadamard_packed": "TacoReduceHadamardPacked",
}
_FMT_CODES = {"e4m3": 0, "e5m2": 1}
#: Message dtypes the handlers read and write as they are (the `MsgDtype` codes of custom_calls/).
NATIVE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_DTYPE_CODES = {d: i for i, d in enumerate(NATIVE_DTYPES)}
#: Interface version the wrappers need (`taco_ffi_abi()` of the library; custom_calls/taco_ffi_bind.h).
FFI_ABI = 2
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}

#: `impl` attribute, the highest CPU kernel level a call may use: 0 = the fastest present, 1 = scalar,
#: 2 = AVX2, 3 = AVX-512. All levels give bit-identical results (CUDA ignores `impl`).
IMPL_AUTO, IMPL_SCALAR, IMPL_AVX2, IMPL_AVX512 = 0, 1, 2, 3


def _impl(impl: int) -> np.int32:
    """`impl` as the custom call's attribute. Raises ValueError naming a value outside 0-3."""
    if impl not in (IMPL_AUTO, IMPL_SCALAR, IMPL_AVX2, IMPL_AVX512):
        raise ValueError(f"impl={impl!r} is not a CPU kernel level: 0 (auto), 1 (scalar), 2 (AVX2), 3 (AVX-512)")
    return np.int32(impl)


def lib_path(platform: str = "cpu") -> Path:
    """Where the shared library for `platform` ("cpu" or "cuda") is expected."""
    return LIB_DIR / LIBS[platform]


#: Environment knobs of the CPU library (read at its first call) -> smallest value: TACO_FFI_THREADS
#: caps the threads per call; TACO_FFI_SPIN_US is how long helpers spin before sleeping (default 200).
ENV_KNOBS = {"TACO_FFI_THREADS": 1, "TACO_FFI_SPIN_US": 0}


def _check_env():
    """Raises ValueError naming a TACO_FFI_* variable that is not an integer >= its minimum (the
    C++ library would otherwise ignore it)."""
    for name, lo in ENV_KNOBS.items():
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            ok = int(raw) >= lo
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{name}={raw!r} must be an integer >= {lo} (or unset)")


@functools.cache
def _load(platform: str) -> str | None:
    """Loads and registers the library for `platform`; returns None, or why it is unavailable."""
    path = lib_path(platform)
    if not path.exists():
        return f"{path} not found; {BUILD_HINT[platform]}"
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:  # e.g. built against another libc / CUDA runtime
        return f"cannot load {path}: {e}; rebuild it ({BUILD_HINT[platform]})"
    abi = getattr(lib, "taco_ffi_abi", None)
    if abi is None or abi() != FFI_ABI:
        return (f"{path} was built from older sources (interface {abi() if abi else 1}, need {FFI_ABI}); "
                f"{BUILD_HINT[platform]}")
    suffix = "Cpu" if platform == "cpu" else "Cuda"
    targets = {**_TARGETS, **(_CPU_TARGETS if platform == "cpu" else {})}
    for name, symbol in targets.items():
        fn = getattr(lib, symbol + suffix, None)
        if fn is None:
            return f"{path} lacks {symbol + suffix} (built from older sources); {BUILD_HINT[platform]}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform=_XLA_PLATFORM[platform])
    return None


def unavailable_reason(platform: str = "cpu") -> str | None:
    """None if the FFI library for `platform` is built and registered, else a reason with a fix."""
    if platform not in LIBS:
        return f"no FFI library for platform {platform!r}"
    return _load(platform)


def available(platform: str = "cpu") -> bool:
    return unavailable_reason(platform) is None


def _ensure_loaded():
    """Registers the FFI targets before a call is traced (`_load` runs once per platform)."""
    _check_env()
    platform = default_platform()
    reason = unavailable_reason(platform)
    if reason is not None:
        raise RuntimeError(f"taco_jax FFI codec unavailable on {platform}: {reason}")


_FMT_OF_DTYPE = {jnp.dtype(jnp.float8_e4m3fn): 0, jnp.dtype(jnp.float8_e5m2): 1}


def _codes_as_u8() -> bool:
    """Whether the decoding and reducing handlers take codes as uint8 (CPU): then the wire codec's
    uint8 view cancels against ours and XLA:CPU copies nothing (a lone bitcast-convert is an
    elementwise copy there). The encoder writes the FP8 type everywhere for the same reason."""
    return default_platform() == "cpu"


def _revary(outs, vma: frozenset):
    """ffi_call's results given their operands' varying axes (jax 0.10 types them invariant)."""
    return tuple(pvary(o, vma) for o in outs)


def _native(x: jax.Array) -> jax.Array:
    """x as the handlers read it: as it is in a native dtype, else cast to float32."""
    return x if jnp.dtype(x.dtype) in _DTYPE_CODES else x.astype(jnp.float32)


def _out_dtype(dtype) -> np.dtype:
    """The dtype a decoding handler writes for a requested `dtype` (None: float32); raises
    ValueError for one it does not write."""
    dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"FFI decode writes one of {[d.name for d in NATIVE_DTYPES]}, got dtype={dtype}")
    return dtype


@functools.partial(jax.jit, inline=True, static_argnames=("cfg", "last_count", "impl"))
def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int, impl: int = IMPL_AUTO):
    """Fused encode, same contract as `taco_jax.codec.reference.encode_groups`; xg may also be
    bfloat16 or float16 (read as it is: bit-identical to encoding `xg.astype(float32)`)."""
    _ensure_loaded()
    *lead, n_groups, g = xg.shape
    x2 = _native(xg).reshape(-1, g)  # [N, G]
    n = x2.shape[0]
    call = jax.ffi.ffi_call(
        "taco_encode",
        (
            jax.ShapeDtypeStruct((n, g), cfg.code_dtype),
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        ),
        vmap_method="broadcast_all",
    )
    outs = call(
        x2,
        fmt=np.int32(_FMT_CODES[cfg.fmt]),
        lam=np.float32(cfg.lam),
        fmax=np.float32(cfg.fmax),
        target_range=np.float32(cfg.target_range),
        n_groups=np.int64(n_groups),
        last_count=np.int64(last_count),
        impl=_impl(impl),
    )
    codes, s, a = _revary(outs, vma_of(x2))
    return codes.reshape(*lead, n_groups, g), s.reshape(*lead, n_groups), a.reshape(*lead, n_groups)


@functools.partial(jax.jit, inline=True, static_argnames=("impl", "dtype"))
def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, *, impl: int = IMPL_AUTO,
                  dtype=None) -> jax.Array:
    """Fused decode, same contract as `taco_jax.codec.reference.decode_groups`; with `dtype` (bfloat16 or float16)
    the values are written in that dtype, bit-identical to `clip_to_dtype(decode_groups(...), dtype).astype(dtype)`
    (`taco_jax.codec.dispatch`). Raises ValueError for another dtype."""
    _ensure_loaded()
    out_dtype = _out_dtype(dtype)
    *lead, n_groups, g = codes.shape
    impl = int(_impl(impl))
    if _codes_as_u8():
        impl |= (_FMT_OF_DTYPE[jnp.dtype(codes.dtype)] + 1) << 8
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    args = [codes.reshape(-1, g), s.astype(jnp.float32).reshape(-1)]
    if a is not None:
        args.append(a.astype(jnp.float32).reshape(-1))
    vma = frozenset().union(*(vma_of(t) for t in args))
    args = [pvary(t, vma) for t in args]  # ffi_call needs its operands to vary alike
    call = jax.ffi.ffi_call(
        "taco_decode", jax.ShapeDtypeStruct(args[0].shape, out_dtype), vmap_method="broadcast_all"
    )
    (out,) = _revary([call(*args, has_a=np.int32(a is not None), impl=np.int32(impl))], vma)
    return out.reshape(*lead, n_groups, g)


def reduce_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, cfg: CodecConfig, *,
                  impl: int = IMPL_AUTO):
    """Fused transform-domain reduction, same contract as `taco_jax.codec.reference.reduce_groups`
    (codes [P, ..., n_groups, G] -> ([..., n_groups, G], [..., n_groups])); one pass over the P
    ranks' codes (C++ `taco_reduce`) on CPU; elsewhere the jnp reference."""
    if default_platform() != "cpu":
        from taco_jax.codec.reference import reduce_groups as ref  # noqa: PLC0415

        return ref(codes, s, a, cfg)
    _ensure_loaded()
    p, *lead, n_groups, g = codes.shape
    code_dtype = codes.dtype
    c8 = jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(p, -1, g)
    s2, a2 = s.astype(jnp.float32).reshape(p, -1), None if a is None else a.astype(jnp.float32).reshape(p, -1)
    # one operand per rank: slices of the all-to-all's result, which XLA forwards without the copy
    # a concatenation into one [P, ...] buffer would take
    args = [c8[r] for r in range(p)] + [s2[r] for r in range(p)] + ([] if a2 is None else [a2[r] for r in range(p)])
    vma = frozenset().union(*(vma_of(t) for t in args))
    args = [pvary(t, vma) for t in args]
    n = c8.shape[1]
    call = jax.ffi.ffi_call("taco_reduce", (jax.ShapeDtypeStruct((n, g), jnp.uint8),
                                            jax.ShapeDtypeStruct((n,), jnp.float32)), vmap_method="broadcast_all")
    out_codes, out_s = _revary(call(*args, fmt=np.int32(_FMT_CODES[cfg.fmt]), has_a=np.int32(a is not None),
                                    target_range=np.float32(cfg.target_range), impl=_impl(impl)), vma)
    out_codes = jax.lax.bitcast_convert_type(out_codes, code_dtype)
    return out_codes.reshape(*lead, n_groups, g), out_s.reshape(*lead, n_groups)


# Packed wire rows (CPU only), as `codec.wire.pack_rows` lays them out (little-endian):
#   [codes: n_groups * G bytes][s: n_groups float32][a: n_groups float32]   dual layout
#   [codes: n_groups * G bytes][s / a: n_groups float32]                    folded layout
# n_groups = ceil(m / G). Bit-identical to the unpacked functions plus packing, sums and slices.


def packed_row_bytes(m: int, cfg: CodecConfig, *, has_a: bool | None = None) -> int:
    """Bytes of one packed row of a message of `m` >= 1 elements: n_groups * (G + 4 * scale words),
    with has_a (default: cfg.scale_layout == "dual") choosing 2 scale words or 1."""
    has_a = cfg.scale_layout == "dual" if has_a is None else has_a
    g = cfg.group_size
    return -(-m // g) * (g + 4 * (2 if has_a else 1))


def _packed_attrs(m: int, cfg: CodecConfig):
    """Encode attributes of the packed targets for messages of m elements (m >= 1)."""
    if cfg.kind != "taco":
        raise ValueError(f"packed FFI targets need a codec of kind 'taco', got kind={cfg.kind!r}")
    if m < 1:
        raise ValueError(f"packed FFI targets need a non-empty message, got m={m}")
    g = cfg.group_size
    n_groups = -(-m // g)
    return dict(fmt=np.int32(_FMT_CODES[cfg.fmt]), lam=np.float32(cfg.lam), fmax=np.float32(cfg.fmax),
                target_range=np.float32(cfg.target_range), g=np.int64(g), n_groups=np.int64(n_groups),
                last_count=np.int64(m - (n_groups - 1) * g), has_a=np.int32(cfg.scale_layout == "dual"))


def _check_rows(rows: jax.Array, m: int, cfg: CodecConfig, has_a: bool, min_rank: int):
    if rows.dtype != jnp.uint8 or rows.ndim < min_rank:
        raise ValueError(f"packed rows must be uint8 of rank >= {min_rank}, got {rows.dtype}{list(rows.shape)}")
    want = packed_row_bytes(m, cfg, has_a=has_a)
    if rows.shape[-1] != want:
        raise ValueError(f"packed rows of m={m} elements (G={cfg.group_size}, has_a={has_a}) are {want} bytes, "
                         f"got last axis {rows.shape[-1]}")


def _pad_rows(x: jax.Array, g: int) -> jax.Array:
    """x [..., m] -> [..., n_groups * G] in a native dtype (else float32), zero-padded as
    `codec.dispatch.encode` pads."""
    x = _native(x)
    pad = -x.shape[-1] % g
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _unpad(y: jax.Array, m: int) -> jax.Array:
    return y if y.shape[-1] == m else y[..., :m]


@functools.partial(jax.jit, inline=True, static_argnames=("cfg", "split", "interleaved", "impl"))
def encode_packed(x: jax.Array, cfg: CodecConfig, *, split: bool = False, interleaved: bool = False,
                  impl: int = IMPL_AUTO):
    """Encodes messages straight into packed wire rows (C++ `taco_encode_packed`, CPU): x float [..., m], m >= 1, one
    message per row (`interleaved`: [..., outer, P, inner], inner % G == 0, read in place as if x were
    `swapaxes(x, -3, -2).reshape(..., P, m)`); `cfg` of kind "taco" ("folded" rows hold s / a computed in float32);
    `split`: x is [..., P, m] and each message along axis -2 gets its own result buffer (no slicing copies).
    Returns: uint8 [..., packed_row_bytes(m, cfg)], byte for byte
    `codec.wire.pack_rows(encode(x, cfg, batch_dims=x.ndim - 1), x.ndim - 1)`; with split, a tuple of P such arrays
    (interleaved without split: [..., P, row_bytes]).
    Raises: ValueError for a non-floating x, another codec kind, m == 0, split with x of rank < 2, or
      interleaved with x of rank < 3 or x.shape[-1] not a multiple of G.
    """
    _ensure_loaded()
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"encode_packed needs a floating-point message, got dtype={x.dtype}")
    outer = 1
    if interleaved:
        if x.ndim < 3 or x.shape[-1] % cfg.group_size or x.shape[-1] == 0:
            raise ValueError(f"encode_packed(interleaved=True) needs x [..., outer, P, inner] with inner a positive "
                             f"multiple of G={cfg.group_size}, got shape {x.shape}")
        outer = x.shape[-3]
        lead, p, m = x.shape[:-3], x.shape[-2], outer * x.shape[-1]
    else:
        lead, m = x.shape[:-1], x.shape[-1]
        p = None
    attrs = _packed_attrs(m, cfg)
    if split and x.ndim < 2:
        raise ValueError(f"encode_packed(split=True) needs x of rank >= 2 ([..., P, m]), got shape {x.shape}")
    x2 = _native(x) if interleaved else _pad_rows(x, cfg.group_size)
    rb = packed_row_bytes(m, cfg)
    if interleaved:
        rows_shape = (*lead, p)
    else:
        rows_shape = lead
    if split:
        outs = tuple(jax.ShapeDtypeStruct((*rows_shape[:-1], rb), jnp.uint8) for _ in range(rows_shape[-1]))
    else:
        outs = (jax.ShapeDtypeStruct((*rows_shape, rb), jnp.uint8),)
    call = jax.ffi.ffi_call("taco_encode_packed", outs, vmap_method="broadcast_all")
    rows = _revary(call(x2, **attrs, impl=_impl(impl), outer=np.int64(outer)), vma_of(x2))
    return rows if split else rows[0]


def _rank_operands(rows, m: int, cfg: CodecConfig, has_a: bool):
    """P ranks' rows as FFI operands, made to vary alike: one [..., P, row_bytes] array, or P
    [..., row_bytes] arrays (passed as they are: no concatenation copy)."""
    if isinstance(rows, (list, tuple)):
        if not rows:
            raise ValueError("packed rows: an empty sequence of ranks")
        for r in rows:
            _check_rows(r, m, cfg, has_a, 1)
        if len({r.shape for r in rows}) != 1:
            raise ValueError(f"packed rows of the P ranks must have one shape, got {[r.shape for r in rows]}")
        args, lead = list(rows), rows[0].shape[:-1]
        if len(args) == 1:  # one operand means [..., P, row_bytes] to the handlers: give it its P = 1 axis
            args = [args[0][..., None, :]]
    else:
        _check_rows(rows, m, cfg, has_a, 2)
        args, lead = [rows], rows.shape[:-2]
    vma = frozenset().union(*(vma_of(t) for t in args))
    return [pvary(t, vma) for t in args], lead, vma


@functools.partial(jax.jit, inline=True, static_argnames=("cfg", "m", "has_a", "outer", "impl", "dtype"))
def decode_packed(rows: jax.Array, cfg: CodecConfig, m: int, *, has_a: bool | None = None,
                  outer: int | None = None, impl: int = IMPL_AUTO, dtype=None) -> jax.Array:
    """Decodes packed wire rows (C++ `taco_decode_packed`, CPU): rows uint8 [..., packed_row_bytes(m, cfg,
    has_a=has_a)], one message of m elements per row; `has_a`: the rows' layout (default: cfg.scale_layout == "dual").

    Args:
      outer: an integer k >= 1 (rows [..., P, row_bytes], m % (k * G) == 0): the result is
        `jnp.moveaxis(decode_packed(rows, cfg, m).reshape(..., P, k, inner), -3, -2)`, written in place.
      dtype: float32 (None), bfloat16 or float16, as `decode_groups(..., dtype=dtype)` writes it;
        overflow groups (scale < 0) decode as `codec.dispatch.decode(..., overflow=True)`.
    Returns: dtype [..., m]; with `outer`, dtype [..., outer, P, m // outer].
    Raises: ValueError for rows of the wrong dtype or width, an `outer` that is not an integer
      >= 1 with m % (outer * G) == 0 (or rows of rank < 2 with it), or another output dtype.
    """
    _ensure_loaded()
    out_dtype = _out_dtype(dtype)
    has_a = cfg.scale_layout == "dual" if has_a is None else bool(has_a)
    _check_rows(rows, m, cfg, has_a, 1 if outer is None else 2)
    g = cfg.group_size
    if outer is None:
        out = jax.ShapeDtypeStruct((*rows.shape[:-1], -(-m // g) * g), out_dtype)
        k = 1
    else:
        if isinstance(outer, bool) or not isinstance(outer, (int, np.integer)) or outer < 1 or m % (outer * g):
            raise ValueError(f"decode_packed: outer={outer!r} must be an integer >= 1 with m={m} a multiple of "
                             f"outer * G = {outer} * {g}")
        k = int(outer)
        out = jax.ShapeDtypeStruct((*rows.shape[:-2], k, rows.shape[-2], m // k), out_dtype)
    call = jax.ffi.ffi_call("taco_decode_packed", out, vmap_method="broadcast_all")
    (y,) = _revary([call(rows, fmt=np.int32(_FMT_CODES[cfg.fmt]), g=np.int64(g), has_a=np.int32(has_a),
                         impl=_impl(impl), outer=np.int64(k))], vma_of(rows))
    return y if outer is not None else _unpad(y, m)


def decode_sum_packed(rows, cfg: CodecConfig, m: int, *, impl: int = IMPL_AUTO, dtype=None) -> jax.Array:
    """Decodes P packed rows and sums them in float32 in rank order (acc = d_0; acc = acc + d_1; ...)
    in one pass (C++ `taco_decode_sum_packed`, CPU): `codec.wire.sum_fp32(decode(...), dtype)` fused.

    Args: rows: uint8 [..., P, row_bytes], or a sequence of P [..., row_bytes] arrays (rank order); cfg; m: elements
      per message; dtype: float32 (None), bfloat16 or float16 (the sum rounded once, not clipped).
    Returns: dtype [..., m].
    Raises: ValueError for rows of the wrong dtype, rank, width or mismatched shapes, or another dtype."""
    _ensure_loaded()
    out_dtype = _out_dtype(dtype)
    args, lead, vma = _rank_operands(rows, m, cfg, cfg.scale_layout == "dual")
    g = cfg.group_size
    out = jax.ShapeDtypeStruct((*lead, -(-m // g) * g), out_dtype)
    call = jax.ffi.ffi_call("taco_decode_sum_packed", out, vmap_method="broadcast_all")
    (y,) = _revary([call(*args, fmt=np.int32(_FMT_CODES[cfg.fmt]), g=np.int64(g),
                         has_a=np.int32(cfg.scale_layout == "dual"), impl=_impl(impl))], vma)
    return _unpad(y, m)


def reduce_packed(rows, cfg: CodecConfig, m: int, *, impl: int = IMPL_AUTO, dtype=None) -> jax.Array:
    """Signal-domain two-shot middle step (C++ `taco_reduce_packed`, CPU):
    `encode_packed(decode_sum_packed(rows, cfg, m, dtype=dtype), cfg)` in one pass, the sum rounded to
    `dtype`, its padding zeroed, overflowed groups written as `codec.dispatch.encode(..., overflow=True)`.

    Args: rows: as `decode_sum_packed`; cfg; m: elements per message; dtype: the message dtype.
    Returns: uint8 [..., packed_row_bytes(m, cfg)].
    Raises: ValueError as `decode_sum_packed`."""
    _ensure_loaded()
    round_to = _DTYPE_CODES[_out_dtype(dtype)]
    attrs = _packed_attrs(m, cfg)
    args, lead, vma = _rank_operands(rows, m, cfg, cfg.scale_layout == "dual")
    out = jax.ShapeDtypeStruct((*lead, packed_row_bytes(m, cfg)), jnp.uint8)
    call = jax.ffi.ffi_call("taco_reduce_packed", out, vmap_method="broadcast_all")
    (y,) = _revary([call(*args, **attrs, impl=_impl(impl), round=np.int32(round_to))], vma)
    return y


def reduce_hadamard_packed(rows, cfg: CodecConfig, m: int, *, impl: int = IMPL_AUTO) -> jax.Array:
    """Transform-domain reduction (`reduce_groups`) of P packed rows (C++
    `taco_reduce_hadamard_packed`, CPU). rows: as `decode_sum_packed`; m: elements per message.
    Returns: uint8 [..., packed_row_bytes(m, cfg, has_a=False)]: the sum, folded layout.
    Raises: ValueError as `decode_sum_packed`."""
    _ensure_loaded()
    attrs = _packed_attrs(m, cfg)
    has_a = cfg.scale_layout == "dual"
    args, lead, vma = _rank_operands(rows, m, cfg, has_a)
    out = jax.ShapeDtypeStruct((*lead, packed_row_bytes(m, cfg, has_a=False)), jnp.uint8)
    call = jax.ffi.ffi_call("taco_reduce_hadamard_packed", out, vmap_method="broadcast_all")
    (y,) = _revary([call(*args, fmt=attrs["fmt"], g=attrs["g"], has_a=np.int32(has_a),
                         target_range=attrs["target_range"], impl=_impl(impl))], vma)
    return y


@functools.partial(jax.jit, inline=True, static_argnames=("dtype", "clamp", "impl"))
def fp8_cast(x: jax.Array, dtype, *, clamp: float = 0.0, impl: int = IMPL_AUTO) -> jax.Array:
    """Elementwise conversion, for tests: float32 <-> FP8 (clamped to ±clamp first if > 0) and, on
    CPU, the kernels' own float32 <-> bfloat16 / float16 conversions."""
    _ensure_loaded()
    call = jax.ffi.ffi_call("taco_fp8_cast", jax.ShapeDtypeStruct(x.shape, dtype), vmap_method="broadcast_all")
    (out,) = _revary([call(x, clamp=np.float32(clamp), impl=_impl(impl))], vma_of(x))
    return out


def cpu_kernel_levels() -> tuple[int, ...]:
    """The `impl` levels the CPU library runs on this machine, lowest first: (IMPL_SCALAR,), then
    IMPL_AVX2 and IMPL_AVX512 where the CPU has them; () if the library is not built."""
    if not available("cpu"):
        return ()
    lib = ctypes.cdll.LoadLibrary(str(lib_path("cpu")))
    level = getattr(lib, "taco_cpu_kernel_level", None)  # absent in a library without the AVX-512 encoder
    top = int(level()) if level is not None else 1 + int(lib.taco_cpu_has_avx2())
    return (IMPL_SCALAR, IMPL_AVX2, IMPL_AVX512)[:top]
