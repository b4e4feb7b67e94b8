"""Plain-jnp reference of the codec family (TACO spec §2 for kind "taco"); the specification other backends match.

Source: TACO (arXiv 2604.24088) §"Adaptive Scale-Hadamard Transform" and "Dual-Scale
Quantization"; COCCL taco plugin (reference CUDA codec). Differences from the plugin are
explicit options (`CodecConfig.nonfinite`), never silent. The other kinds' group math is in
`taco_jax.codec.family`; `encode` / `decode` below are the one interface to all of them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.codec import constants as C
from taco_jax.codec.backends import GroupBackend, get_backend, get_reducer, register_backend, register_reducer
from taco_jax.codec.config import CODE_BITS, CODEC_KINDS, CodecConfig
from taco_jax.codec.family import GROUP_CODECS
from taco_jax.codec.hadamard import wht
from taco_jax.codec.nonfinite import check_finite


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Encoded:
    """One or more encoded messages, as they travel on the wire: every array leaf is a wire buffer.

    Attributes:
      codes: [*batch, n_groups, G] codes in `cfg.code_dtype`: FP8 (fp8_*, taco), int8, or uint8
        holding two 4-bit codes per byte ([*batch, n_groups, G/2]; int4, tah). fp8_tensor:
        [*batch, 1, n] (one group = the message, no padding).
      scale: float32 [*batch, n_groups]: s (taco dual), s/a (taco folded), the absmax scale
        (fp8_*, int8, int4) or the tile step (tah).
      prescale: float32 [*batch, n_groups] or None: taco's adaptive scale a (dual layout), tah's
        zero point (tile minimum); None otherwise.
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


# --------------------------------------------------------------------------------------
# Group math: [..., n_groups, G] float32 <-> codes + scales. Kernel backends implement these two.
# --------------------------------------------------------------------------------------


def encode_groups(xg: jax.Array, cfg: CodecConfig, *, last_count: int):
    """Encodes groups (spec §2 steps 1-5).

    Args:
      xg: float32 [..., n_groups, G], the last group zero-padded past `last_count`.
      cfg: codec configuration (fmt, group_size, lam, target_range).
      last_count: real element count of the last group (1..G); its mean square uses it.

    Returns:
      (codes fp8 [..., n_groups, G], s float32 [..., n_groups], a float32 [..., n_groups]).
      A group holding NaN/±Inf gets s = NaN (so it decodes to NaN).
    """
    g = cfg.group_size
    n_groups = xg.shape[-2]
    counts = np.full((n_groups,), g, np.float32)
    counts[-1] = last_count
    m = jnp.sum(xg * xg, axis=-1) / counts  # 1. mean square over real elements
    v = jnp.maximum(m + np.float32(cfg.lam), C.EPS)
    a = jnp.clip(np.float32(cfg.fmax) / jnp.sqrt(v), C.ADAPTIVE_SCALE_MIN, C.ADAPTIVE_SCALE_MAX)  # 2. adaptive scale
    y = wht(a[..., None] * xg)  # 3. orthonormal WHT per group
    r = np.float32(cfg.target_range)
    s = jnp.clip(jnp.maximum(jnp.max(jnp.abs(y), axis=-1), C.EPS) / r, C.EPS, C.SCALE_MAX)  # 4.
    finite = jnp.all(jnp.isfinite(xg), axis=-1)
    s = jnp.where(finite, s, np.float32(np.nan))  # non-finite group -> NaN scale
    codes = jnp.clip(y / s[..., None], -r, r).astype(cfg.code_dtype)  # 5. RNE, saturating
    return codes, s, a


def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None) -> jax.Array:
    """Decodes groups: x' = WHT(fp8(q) * s) / max(a, EPS); `a=None` for the folded layout.

    Args:
      codes: fp8 [..., n_groups, G]; s, a: float32 [..., n_groups].
    Returns: float32 [..., n_groups, G].
    """
    x = wht(codes.astype(jnp.float32) * s[..., None])
    if a is not None:
        x = x / jnp.maximum(a, C.EPS)[..., None]
    return x


def reduce_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None, cfg: CodecConfig):
    """Transform-domain reduction (two-shot all-reduce, `reduce_domain="hadamard"`): sums P ranks'
    encoded groups without leaving the Hadamard domain and requantizes the sum.

    The WHT is linear, so with z_r = q_r * (s_r / max(a_r, EPS)) ≈ WHT(x_r) (step 5 undone, no
    inverse transform), Σ_r z_r ≈ WHT(Σ_r x_r). The sum (FP32, in rank order) is quantized with
    an absmax scale and no transform (a = 1): s' = clip(max(max|Σz|, EPS) / R, EPS, SCALE_MAX),
    codes' = fp8(clip(Σz * (1 / s'), -R, R)) (1/s' rounded once to float32; round to nearest
    even, saturating), so that
    `decode_groups(codes', s', None)` = WHT(codes' * s') is the sum in the signal domain. Two
    transforms fewer per group than decode -> sum -> encode.

    Args:
      codes: cfg.code_dtype [P, ..., n_groups, G]; s, a: float32 [P, ..., n_groups] (a=None: the
        folded layout, s already s/a).
      cfg: the taco codec that encoded them (fmt, target_range).
    Returns:
      (codes' cfg.code_dtype [..., n_groups, G], s' float32 [..., n_groups]). A group whose sum is
      not finite (an input group held NaN/±Inf, so its s was NaN) gets s' = NaN (decodes to NaN).
    """
    k = s if a is None else s / jnp.maximum(a, C.EPS)
    z = codes.astype(jnp.float32) * k[..., None]
    acc = z[0]
    for r in range(1, z.shape[0]):
        acc = acc + z[r]
    r = np.float32(cfg.target_range)
    s2 = jnp.clip(jnp.maximum(jnp.max(jnp.abs(acc), axis=-1), C.EPS) / r, C.EPS, C.SCALE_MAX)
    s2 = jnp.where(jnp.all(jnp.isfinite(acc), axis=-1), s2, np.float32(np.nan))
    codes2 = jnp.clip(acc * (np.float32(1) / s2)[..., None], -r, r).astype(cfg.code_dtype)
    return codes2, s2


# --------------------------------------------------------------------------------------
# Message layout: any shape <-> groups.
# --------------------------------------------------------------------------------------


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


def encode(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0) -> Encoded:
    """Encodes each message of `x` with the codec `cfg.kind` (inside `jax.named_scope("taco_encode")`).

    Args:
      x: float array [*batch, *shape]; the leading `batch_dims` axes index independent
        messages (e.g. the P chunks of a two-shot all-reduce); each message is flattened
        (after moving channels first if `cfg.group_axis == "token"`) and cut into groups of
        `cfg.group_size`, the last one zero-padded (fp8_tensor: one group per message). A
        zero-size `x` gives an `Encoded` of zero-size buffers (no groups when a message is empty).
      cfg: a `CodecConfig` of a compressing kind (not "none"); kind "taco" runs the group math of
        the registered backend `cfg.backend` (`taco_jax.codec.backends`; "auto", the default,
        is resolved here, at trace time, for jax's default platform: `backends.resolve_auto`).
      batch_dims: number of leading message axes.

    Returns:
      An `Encoded` pytree (see its docstring).

    Raises:
      ValueError: if `cfg.kind` is "none", `x` is not floating point, or `cfg.backend` is not
        registered or cannot run here.
    """
    if cfg.kind == "none":
        raise ValueError(f"encode needs a compressing codec (kind 'taco' or another of {CODEC_KINDS[1:]}); "
                         "kind='none' is the exact collective and has no encoding")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"encode needs a floating-point message, got dtype={x.dtype}")
    with jax.named_scope("taco_encode"):
        return _encode(x, cfg, batch_dims)


def _encode(x: jax.Array, cfg: CodecConfig, batch_dims: int) -> Encoded:
    shape = tuple(x.shape[batch_dims:])
    n = math.prod(shape)
    if x.size == 0:
        return _empty_encoded(x, cfg, batch_dims)
    rows = _message_to_rows(x, cfg, batch_dims).astype(jnp.float32)
    if cfg.nonfinite == "zero":
        rows = jnp.where(jnp.isfinite(rows), rows, 0.0)
    if cfg.kind == "fp8_tensor":
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
    if cfg.kind == "taco":
        codes, s, a = get_backend(cfg.backend).encode_groups(xg, cfg, last_count=last_count)
        if cfg.scale_layout == "folded":
            s, a = s / a, None
    else:
        codes, s, a = GROUP_CODECS[cfg.kind][0](xg, cfg)
    if cfg.nonfinite == "error":
        check_finite(rows, cfg.site)
    return Encoded(codes, s, a, shape, np.dtype(x.dtype))


def _empty_encoded(x: jax.Array, cfg: CodecConfig, batch_dims: int) -> Encoded:
    """The wire buffers of zero-size input: the shapes `encode` gives, with no group math run."""
    batch, shape = x.shape[:batch_dims], tuple(x.shape[batch_dims:])
    n = math.prod(shape)
    if cfg.kind == "fp8_tensor":
        n_groups, width = (1 if n else 0), n
    else:
        n_groups, width = -(-n // cfg.group_size), cfg.group_size * CODE_BITS[cfg.kind] // 8
    codes = jnp.zeros((*batch, n_groups, width), cfg.code_dtype)
    s = jnp.zeros((*batch, n_groups), jnp.float32)
    has_prescale = cfg.kind == "tah" or (cfg.kind == "taco" and cfg.scale_layout == "dual")
    return Encoded(codes, s, s if has_prescale else None, shape, np.dtype(x.dtype))


def decode(enc: Encoded, cfg: CodecConfig, dtype=None) -> jax.Array:
    """Decodes an `Encoded` back to [*batch, *enc.shape] in `dtype` (default: the encoded dtype),
    inside `jax.named_scope("taco_decode")`.

    With `cfg.nonfinite` "propagate" or "error" a group that held NaN/±Inf decodes to NaN;
    with "zero" every non-finite output is replaced by 0 (COCCL plugin behaviour). For a
    narrower `dtype` than float32 finite values are clipped to its finite range (a decoded
    float16 never overflows to Inf); float32 output is left alone (it could only overflow for
    inputs within rounding of float32's largest value), so the float32 program has no extra op.
    Zero-size buffers decode to a zero-size array, with no group math run.

    Raises: ValueError if `cfg.backend` is not registered or cannot run here (kind "taco"; "auto"
    is resolved as in `encode`).
    """
    with jax.named_scope("taco_decode"):
        n = math.prod(enc.shape)
        batch = enc.scale.shape[:-1]
        if enc.codes.size == 0:
            rows = jnp.zeros((*batch, n), jnp.float32)
        else:
            if cfg.kind == "taco":
                xg = get_backend(cfg.backend).decode_groups(enc.codes, enc.scale, enc.prescale)
            else:
                xg = GROUP_CODECS[cfg.kind][1](enc.codes, enc.scale, enc.prescale, cfg)
            rows = xg.reshape(*xg.shape[:-2], -1)[..., :n]
        if cfg.nonfinite == "zero":
            rows = jnp.where(jnp.isfinite(rows), rows, 0.0)
        dtype = jnp.dtype(dtype or enc.dtype)
        return _rows_to_message(clip_to_dtype(rows, dtype), enc.shape, cfg).astype(dtype)


def clip_to_dtype(rows: jax.Array, dtype) -> jax.Array:
    """Decoded float32 values clipped to the finite range of a narrower `dtype` (float16, bfloat16),
    so that casting them never overflows to Inf (NaN stays NaN); unchanged for float32 or wider.
    `decode` applies it before its cast; the compressed collectives' fused wire path too."""
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
    """Sums the P messages of `enc` (batch axis 0) in the Hadamard domain and requantizes the sum
    (`reduce_groups`; the backend's own kernel when it has one), inside
    `jax.named_scope("taco_reduce")`.

    Args:
      enc: an `Encoded` of kind "taco" with a leading batch axis of P messages of equal shape
        (`encode(x, cfg, batch_dims=1)`, as received by the two-shot all-to-all).
      cfg: the codec that encoded them.
    Returns: an `Encoded` of the sum, [*enc.shape], in the folded layout (prescale None): decode it
      with `dataclasses.replace(cfg, scale_layout="folded")`.
    Raises: ValueError if `cfg.kind` is not "taco" (the other kinds have no transform domain here).
    """
    if cfg.kind != "taco":
        raise ValueError(f"reduce_encoded (transform-domain reduction) needs kind 'taco', got kind={cfg.kind!r}")
    with jax.named_scope("taco_reduce"):
        if enc.codes.size == 0:
            return Encoded(enc.codes[0], enc.scale[0], None, enc.shape, enc.dtype)
        fn = get_reducer(cfg.backend) or reduce_groups
        codes, s = fn(enc.codes, enc.scale, enc.prescale, cfg)
        return Encoded(codes, s, None, enc.shape, enc.dtype)
