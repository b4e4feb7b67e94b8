"""The codec's dispatcher: `encode` / `decode` of every kind, the `Encoded` wire buffers, and `resolve_codec`.

Messages are cut into groups and handed to the kind's group math (`taco_jax.codec.kinds`): kind
"taco" to the group backend `cfg.backend` ("reference" registered here), the others to
`codec.family`. `resolve_codec` is the one place where "auto" fields become concrete."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax.codec import constants as C
from taco_jax.codec.backends import (
    GroupBackend,
    default_platform,
    get_backend,
    get_native,
    get_reducer,
    register_backend,
    register_reducer,
    resolve_backend,
    wire_runs_on,
)
from taco_jax.codec.config import TRANSPORTS, CodecConfig
from taco_jax.codec.kinds import codec_kinds, get_kind
from taco_jax.codec.nonfinite import check_finite
from taco_jax.codec.reference import decode_groups, encode_groups, reduce_groups, sum_fp32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Encoded:
    """One or more encoded messages, as they travel on the wire: every array leaf is a wire buffer.

    Attributes:
      codes: [*batch, n_groups, G] in `cfg.code_dtype` (uint8 [..., G/2] for 4-bit kinds;
        fp8_tensor: [*batch, 1, n]).
      scale: [*batch, n_groups] in `cfg.scale_dtype`: s (taco dual), s/a (taco folded), the absmax
        scale or the tile step (tah).
      prescale: like scale (taco dual: a; tah: the zero point), or None (`CodecKind.prescale`).
      shape: static shape of one message (without the batch axes).
      dtype: static dtype the message is decoded back to.
    """

    codes: jax.Array
    scale: jax.Array
    prescale: jax.Array | None
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        """Bytes of all wire buffers (codes + scales)."""
        return sum(int(np.prod(b.shape)) * b.dtype.itemsize for b in jax.tree.leaves(self))


# --- Message layout: any shape <-> groups.


def _message_to_rows(x: jax.Array, cfg: CodecConfig, batch_dims: int) -> jax.Array:
    """[*batch, *shape] -> [*batch, n] in the order groups are cut."""
    batch, shape = x.shape[:batch_dims], x.shape[batch_dims:]
    if cfg.group_axis == "token" and len(shape) >= 2:
        x = x.reshape(*batch, math.prod(shape[:-1]), shape[-1])
        x = jnp.swapaxes(x, -1, -2)  # one channel across tokens is contiguous
    return x.reshape(*batch, math.prod(shape))


def _rows_to_message(x: jax.Array, shape: tuple[int, ...], cfg: CodecConfig) -> jax.Array:
    batch = x.shape[:-1]
    if cfg.group_axis == "token" and len(shape) >= 2:
        x = x.reshape(*batch, shape[-1], math.prod(shape[:-1]))
        x = jnp.swapaxes(x, -1, -2)
    return x.reshape(*batch, *shape)


def encode(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0, overflow: bool = False) -> Encoded:
    """Encodes each message of `x` with the codec `cfg.kind` (inside `jax.named_scope("taco_encode")`).

    Args:
      x: float array [*batch, *shape]; each message is flattened (channels first for group_axis "token") and cut into
        groups of `cfg.group_size`, the last zero-padded (fp8_tensor: one group). Zero-size `x` gives zero-size buffers.
      cfg: a codec of a compressing kind ("auto" backend resolved here); batch_dims: leading message axes.
      overflow: `x` is a two-shot partial sum: a group holding ±Inf and no NaN is sent as an overflow group
        (`overflow_groups`).
    Returns: an `Encoded` pytree.
    Raises: ValueError if `cfg.kind` is "none", `x` is not floating point, or `cfg.backend` is not
      registered or cannot run here.
    """
    if cfg.kind == "none":
        raise ValueError(f"encode needs a compressing codec (kind 'taco' or another of {codec_kinds()[1:]}); "
                         "kind='none' is the exact collective and has no encoding")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"encode needs a floating-point message, got dtype={x.dtype}")
    with jax.named_scope("taco_encode"):
        return _encode(x, cfg, batch_dims, overflow and _overflow_codes(cfg))


def _encode(x: jax.Array, cfg: CodecConfig, batch_dims: int, overflow: bool = False) -> Encoded:
    shape = tuple(x.shape[batch_dims:])
    n = math.prod(shape)
    if x.size == 0:
        return _empty_encoded(x, cfg, batch_dims)
    rows = _message_to_rows(x, cfg, batch_dims)
    if not (_native(cfg, x.dtype) and cfg.nonfinite != "zero"):
        rows = rows.astype(jnp.float32)
    if cfg.nonfinite == "zero":
        rows = jnp.where(jnp.isfinite(rows), rows, 0.0)
    kind = get_kind(cfg.kind)
    if not kind.grouped:
        xg = rows[..., None, :]  # the whole message is one group
        last_count = n
    else:
        g = cfg.group_size
        n_groups = -(-n // g)
        pad = n_groups * g - n
        if pad:
            rows = jnp.pad(rows, [(0, 0)] * batch_dims + [(0, pad)])
        xg = rows.reshape(*rows.shape[:-1], n_groups, g)
        last_count = n - (n_groups - 1) * g
    codes, s, a = kind.encode(xg, cfg, last_count=last_count)
    if overflow:
        codes, s, a = overflow_groups(xg, codes, s, a, cfg)
    if cfg.nonfinite == "error":
        check_finite(rows, cfg.site)
    return Encoded(codes, s, a, shape, np.dtype(x.dtype))


# --- Overflow groups: the two-shot all-reduce's partial sums that overflowed the message dtype.

#: The code byte of a ±Inf element in an overflow group (| 0x80 for -Inf): codes no finite value
#: takes (the quantizer saturates): E4M3FN's NaN (it has no Inf), E5M2's Inf.
INF_CODE = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7C}


def _overflow_codes(cfg: CodecConfig) -> bool:
    """Whether overflow groups exist for `cfg`: its kind takes them (`CodecKind.overflow`), nonfinite not "zero"."""
    return cfg.kind != "none" and get_kind(cfg.kind).overflow and cfg.nonfinite != "zero"


def overflow_groups(xg: jax.Array, codes: jax.Array, scale: jax.Array, prescale, cfg: CodecConfig):
    """The groups of `xg` that hold ±Inf and no NaN, re-encoded as overflow groups; the others unchanged.

    Why: a two-shot partial sum of finite values may overflow the message dtype (float16 at 65520),
    ±Inf in that element only, where a NaN scale would poison the whole group. Format, no transform:
    scale = -s (the sign marks the group), s = max(max|x_finite|, EPS) * (1 / R), codes = fp8(clip(x * (1 / s), -R,
    R)) (float32 reciprocals, RNE), `INF_CODE` (| 0x80 for -Inf) for the infinite elements; prescale = 1. Decoded by
    `decode(..., overflow=True)`: fp8(code) * |scale|. The C++ reducer (`taco_reduce_packed`) writes the same bytes.

    xg: [..., n_groups, G] the groups as encoded (float32 or a native message dtype); codes, scale, prescale: what the
    kind's encoder gave for them (scale in its layout); cfg: a kind with `CodecKind.overflow`.
    Returns: (codes, scale, prescale)."""
    inf = jnp.isinf(xg)
    over = jnp.any(inf, axis=-1) & ~jnp.any(jnp.isnan(xg), axis=-1)
    xf = jnp.where(inf, 0, xg).astype(jnp.float32)
    r = np.float32(cfg.target_range)
    s = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), C.EPS) * (np.float32(1) / r)
    q = jnp.clip(xf * (np.float32(1) / s)[..., None], -r, r)
    q = lax.bitcast_convert_type(q.astype(cfg.code_dtype), jnp.uint8)
    inf_code = np.uint8(INF_CODE[jnp.dtype(cfg.code_dtype).name])
    q = jnp.where(inf, jnp.where(xg < 0, inf_code | np.uint8(0x80), inf_code), q)
    bits = lax.bitcast_convert_type(codes, jnp.uint8)
    codes = lax.bitcast_convert_type(jnp.where(over[..., None], q, bits), codes.dtype)
    scale = jnp.where(over, -s, scale)
    if prescale is not None:
        prescale = jnp.where(over, np.float32(1), prescale)
    return codes, scale, prescale


def _decode_overflow(rows: jax.Array, enc: Encoded, dtype, n: int) -> jax.Array:
    """`rows` (decoded messages [*batch, n] in `dtype`) with the overflow groups of `enc` (scale < 0, `overflow_groups`)
    decoded as such: fp8(code) * |scale| clipped to `dtype`'s finite range, ±Inf for an `INF_CODE`."""
    over = enc.scale < 0
    v = enc.codes.astype(jnp.float32)
    neg = lax.bitcast_convert_type(enc.codes, jnp.uint8) >= 0x80
    val = clip_to_dtype(v * -enc.scale[..., None], dtype)
    val = jnp.where(jnp.isfinite(v), val, jnp.where(neg, -np.inf, np.inf).astype(jnp.float32)).astype(dtype)
    mask = jnp.broadcast_to(over[..., None], val.shape)
    flat = lambda t: t.reshape(*t.shape[:-2], -1)[..., :n]  # noqa: E731
    return jnp.where(flat(mask), flat(val), rows)


def wire_layout(cfg: CodecConfig, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each wire buffer of one message, in `Encoded`'s leaf order: codes
    [n_groups, width], scale [n_groups], and prescale [n_groups] where the layout has one."""
    kind = get_kind(cfg.kind)
    n = math.prod(shape)
    if not kind.grouped:
        n_groups, width = (1 if n else 0), n
    else:
        n_groups, width = -(-n // cfg.group_size), cfg.group_size * kind.code_bits // 8
    scale = ((n_groups,), np.dtype(kind.scale_dtype))
    return [((n_groups, width), np.dtype(cfg.code_dtype)), scale, *([scale] if kind.has_prescale(cfg) else [])]


def _empty_encoded(x: jax.Array, cfg: CodecConfig, batch_dims: int) -> Encoded:
    """The wire buffers of zero-size input: the shapes `encode` gives, with no group math run."""
    batch, shape = x.shape[:batch_dims], tuple(x.shape[batch_dims:])
    (codes_shape, code_dtype), (s_shape, s_dtype), *prescale = wire_layout(cfg, shape)
    codes = jnp.zeros((*batch, *codes_shape), code_dtype)
    s = jnp.zeros((*batch, *s_shape), s_dtype)
    return Encoded(codes, s, s if prescale else None, shape, np.dtype(x.dtype))


def decode(enc: Encoded, cfg: CodecConfig, dtype=None, *, overflow: bool = False) -> jax.Array:
    """Decodes an `Encoded` back to [*batch, *enc.shape] in `dtype` (default: the encoded dtype),
    inside `jax.named_scope("taco_decode")`.

    A group that held NaN/±Inf decodes to NaN (nonfinite "zero": every non-finite output to 0).
    Values are clipped to a dtype narrower than float32 (float32: no extra op). `overflow`: `enc`
    may hold overflow groups (`overflow_groups`). Raises: ValueError as `encode` for the backend."""
    with jax.named_scope("taco_decode"):
        dtype = jnp.dtype(dtype or enc.dtype)
        n = math.prod(enc.shape)
        batch = enc.scale.shape[:-1]
        backend = get_backend(cfg.backend) if cfg.kind == "taco" else None
        native = _native(cfg, dtype) and cfg.nonfinite != "zero" and enc.codes.size
        if enc.codes.size == 0:
            rows = jnp.zeros((*batch, n), jnp.float32)
        else:
            if native:  # decoded straight into dtype, clipped by the kernel
                xg = backend.decode_groups(enc.codes, enc.scale, enc.prescale, dtype=dtype)
            else:
                xg = get_kind(cfg.kind).decode(enc.codes, enc.scale, enc.prescale, cfg)
            rows = xg.reshape(*xg.shape[:-2], -1)[..., :n]
        if cfg.nonfinite == "zero":
            rows = jnp.where(jnp.isfinite(rows), rows, 0.0)
        if not native:
            rows = clip_to_dtype(rows, dtype).astype(dtype)
        if overflow and _overflow_codes(cfg) and enc.codes.size:
            rows = _decode_overflow(rows, enc, dtype, n)
        return _rows_to_message(rows, enc.shape, cfg)


def decode_sum(enc: Encoded, cfg: CodecConfig, dtype=None) -> jax.Array:
    """The P messages of `enc` (batch axis 0) decoded, summed in FP32 in rank order and cast once to
    `dtype` (default: the encoded dtype): [*enc.shape]. Uses the backend's fused `decode_sum_groups`
    where it applies. Raises: ValueError as `decode`."""
    dtype = jnp.dtype(dtype or enc.dtype)
    fused_fn = get_native(cfg.backend).decode_sum_groups if cfg.kind == "taco" else None
    fused = (fused_fn is not None and cfg.nonfinite != "zero" and enc.codes.size
             and (dtype == jnp.float32 or _native(cfg, dtype)))
    if not fused:
        return sum_fp32(decode(enc, cfg, jnp.float32), dtype)
    with jax.named_scope("taco_decode"):
        xg = fused_fn(enc.codes, enc.scale, enc.prescale, dtype=dtype)
        rows = xg.reshape(*xg.shape[:-2], -1)[..., : math.prod(enc.shape)]
        return _rows_to_message(rows, enc.shape, cfg)


def _native(cfg: CodecConfig, dtype) -> bool:
    """Whether the group backend of `cfg` (kind taco) reads / writes messages of `dtype` as they are
    (`backends.register_native`)."""
    return cfg.kind == "taco" and jnp.dtype(dtype).name in get_native(cfg.backend).dtypes


def clip_to_dtype(rows: jax.Array, dtype) -> jax.Array:
    """float32 values clipped to the finite range of a narrower `dtype`, so the cast never overflows
    to Inf (NaN stays NaN); unchanged for float32 or wider."""
    dtype = jnp.dtype(dtype)
    if jnp.finfo(dtype).max < jnp.finfo(jnp.float32).max:
        big = np.float32(jnp.finfo(dtype).max)
        rows = jnp.clip(rows, -big, big)
    return rows


def roundtrip(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0) -> jax.Array:
    """decode(encode(x)) — what the receiver of one compressed message sees (`x` itself for "none")."""
    if cfg.kind == "none":
        return x
    return decode(encode(x, cfg, batch_dims=batch_dims), cfg)


register_backend("reference", lambda: GroupBackend(encode_groups, decode_groups))
register_reducer("reference", reduce_groups)


def reduce_encoded(enc: Encoded, cfg: CodecConfig) -> Encoded:
    """Sums the P messages of `enc` (batch axis 0, `encode(x, cfg, batch_dims=1)`) in the Hadamard
    domain and requantizes the sum (`reduce_groups`, or the backend's kernel).

    Returns: an `Encoded` of the sum [*enc.shape] in the folded layout (prescale None): decode it
      with `dataclasses.replace(cfg, scale_layout="folded")`.
    Raises: ValueError if the kind has no transform-domain reduction (`CodecKind.transform_reduce`)."""
    if cfg.kind == "none" or not get_kind(cfg.kind).transform_reduce:
        raise ValueError(f"reduce_encoded (transform-domain reduction) needs kind 'taco', got kind={cfg.kind!r}")
    with jax.named_scope("taco_reduce"):
        if enc.codes.size == 0:
            return Encoded(enc.codes[0], enc.scale[0], None, enc.shape, enc.dtype)
        fn = get_reducer(cfg.backend) or reduce_groups
        codes, s = fn(enc.codes, enc.scale, enc.prescale, cfg)
        return Encoded(codes, s, None, enc.shape, enc.dtype)


# --- Resolution of "auto": the one place.

def gloo_collectives() -> bool:
    """Whether XLA:CPU runs this process's collectives through gloo: `jax.distributed` initialized
    and jax's default backend is the CPU."""
    return jax.default_backend() == "cpu" and jax.distributed.is_initialized()


def resolve_transport(name: str = "auto", run: str = "auto") -> str:
    """The concrete transport `name` stands for: `name` if concrete, else the run's `run` (its
    `--transport`) if concrete, else "gloo" when `gloo_collectives()`, else "xla". (`run="gloo"` in
    one process compiles the multi-process CPU program.) Raises ValueError outside `TRANSPORTS`."""
    for what, value in (("transport", name), ("run transport", run)):
        if value not in TRANSPORTS:
            raise ValueError(f"{what}={value!r} must be one of {TRANSPORTS}")
    if name != "auto":
        return name
    if run != "auto":
        return run
    return "gloo" if gloo_collectives() else "xla"


def _resolve_wire(cfg: CodecConfig, backend: str, platform: str) -> str:
    """`cfg.wire` made concrete: "auto" -> the backend's own wire codec where it runs and fits
    (taco, "hidden", "propagate"), else "generic". Raises ValueError for one that cannot run here."""
    fits = _backends(cfg) and cfg.group_axis == "hidden" and cfg.nonfinite == "propagate"
    if cfg.wire == "auto":
        return backend if fits and wire_runs_on(backend, platform) else "generic"
    if cfg.wire != "generic" and not (cfg.wire == backend and wire_runs_on(backend, platform)):
        raise ValueError(f"wire={cfg.wire!r} cannot run on {platform} with backend {backend!r}; use wire='generic'")
    return cfg.wire


def resolve_codec(cfg: CodecConfig, platform: str | None = None, *, n_devices: int = 1,
                  transport: str = "auto") -> CodecConfig:
    """`cfg` with every "auto" made concrete: `backend` (kind "taco": the registered resolver's
    choice; other kinds "reference"), `wire` (`_resolve_wire`), `transport` (`resolve_transport`).

    Args: platform: default `backends.default_platform()`. n_devices: devices of the program (the
      resolver refuses backends that stall a multi-device program). transport: the run's transport.
    Raises: ValueError naming a backend or wire codec that cannot run here, or a bad transport."""
    platform = platform or default_platform()
    backend = resolve_backend(cfg.backend, platform, n_devices=n_devices) if _backends(cfg) else "reference"
    wire = _resolve_wire(cfg, backend, platform)
    transport = resolve_transport(cfg.transport, transport)
    if (backend, wire, transport) == (cfg.backend, cfg.wire, cfg.transport):
        return cfg
    return dataclasses.replace(cfg, backend=backend, wire=wire, transport=transport)


def _backends(cfg: CodecConfig) -> bool:
    """Whether `cfg`'s kind runs its group math through the registered group backends (taco)."""
    return cfg.kind != "none" and get_kind(cfg.kind).backends


def is_resolved(cfg: CodecConfig) -> bool:
    """Whether no field of `cfg` is "auto" (`resolve_codec` would return it unchanged)."""
    return "auto" not in (cfg.backend, cfg.wire, cfg.transport)
