"""Plain-jnp reference of the codec family (TACO spec §2 for kind "taco"); the specification other backends match.

Source: TACO (arXiv 2604.24088) §"Adaptive Scale-Hadamard Transform" and "Dual-Scale
Quantization"; COCCL taco plugin (reference CUDA codec). Differences from the plugin are
explicit options (`CodecConfig.nonfinite`), never silent. The other kinds' group math is in
`taco_jax.codec.family`; `encode` / `decode` below are the one interface to all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from taco_jax.codec.config import CODEC_KINDS, CodecConfig
from taco_jax.codec.family import GROUP_CODECS

_EPS = 1e-12


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


@functools.cache
def hadamard(g: int) -> np.ndarray:
    """Sylvester-order Hadamard matrix H_g (float32, entries ±1), from `scipy.linalg.hadamard`."""
    return scipy.linalg.hadamard(g).astype(np.float32)


def wht(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform over the last axis: x @ H_G / sqrt(G) (its own inverse)."""
    g = x.shape[-1]
    h = jnp.asarray(hadamard(g))
    return jnp.matmul(x, h, precision=jax.lax.Precision.HIGHEST) / np.float32(math.sqrt(g))


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
    v = jnp.maximum(m + np.float32(cfg.lam), _EPS)
    a = jnp.clip(np.float32(cfg.fmax) / jnp.sqrt(v), 1e-3, 1e3)  # 2. adaptive scale
    y = wht(a[..., None] * xg)  # 3. orthonormal WHT per group
    r = np.float32(cfg.target_range)
    s = jnp.clip(jnp.maximum(jnp.max(jnp.abs(y), axis=-1), _EPS) / r, _EPS, 1e6)  # 4.
    finite = jnp.all(jnp.isfinite(xg), axis=-1)
    s = jnp.where(finite, s, np.float32(np.nan))  # non-finite group -> NaN scale
    codes = jnp.clip(y / s[..., None], -r, r).astype(cfg.code_dtype)  # 5. RNE, saturating
    return codes, s, a


def decode_groups(codes: jax.Array, s: jax.Array, a: jax.Array | None) -> jax.Array:
    """Decodes groups: x' = WHT(fp8(q) * s) / max(a, 1e-12); `a=None` for the folded layout.

    Args:
      codes: fp8 [..., n_groups, G]; s, a: float32 [..., n_groups].
    Returns: float32 [..., n_groups, G].
    """
    x = wht(codes.astype(jnp.float32) * s[..., None])
    if a is not None:
        x = x / jnp.maximum(a, _EPS)[..., None]
    return x


# --------------------------------------------------------------------------------------
# Message layout: any shape <-> groups.
# --------------------------------------------------------------------------------------


def _backend(cfg: CodecConfig):
    if cfg.backend == "reference":
        return encode_groups, decode_groups
    from taco_jax import kernels  # noqa: PLC0415  (kernels depend on codec, not the reverse)

    return kernels.get_backend(cfg.backend)


def _message_to_rows(x: jax.Array, cfg: CodecConfig, batch_dims: int) -> jax.Array:
    """[*batch, *shape] -> [*batch, n] in the order groups are cut."""
    batch, shape = x.shape[:batch_dims], x.shape[batch_dims:]
    if cfg.group_axis == "token" and len(shape) >= 2:
        x = x.reshape(*batch, -1, shape[-1])
        x = jnp.swapaxes(x, -1, -2)  # one channel across tokens is contiguous
    return x.reshape(*batch, -1)


def _rows_to_message(x: jax.Array, shape: tuple[int, ...], cfg: CodecConfig) -> jax.Array:
    batch = x.shape[:-1]
    if cfg.group_axis == "token" and len(shape) >= 2:
        x = x.reshape(*batch, shape[-1], -1)
        x = jnp.swapaxes(x, -1, -2)
    return x.reshape(*batch, *shape)


_NONFINITE_SITES: list[str] = []  # host side: sites whose "error"-policy check saw NaN/Inf
_REPORT_LOCK = threading.Lock()


def _report_nonfinite(*, site: str):
    site = site or "<unnamed>"
    with _REPORT_LOCK:
        first = site not in _NONFINITE_SITES
        _NONFINITE_SITES.append(site)
    if first:
        print(f"taco_jax: non-finite value (NaN/Inf) in a message at site {site!r}", file=sys.stderr)


def check_finite(rows: jax.Array, site: str) -> None:
    """The "error" policy's device-side check: reports `site` to the host if `rows` holds NaN/±Inf.

    Mechanism (works inside `jit`, `shard_map` and `custom_vjp` backward rules, jax >= 0.10.2):
    `lax.cond(all finite, nothing, jax.debug.callback(report))` — the callback takes no array
    operands and only runs on a rank that saw a non-finite value; it records the site and prints
    it. `raise_if_nonfinite()` then raises `FloatingPointError` naming the site(s) on the host
    (the training loop calls it after every step). Raising *inside* the callback is not used: on
    a multi-device mesh the failing rank leaves its peers waiting in the next collective, and
    XLA aborts the process; `checkify` is not used: it needs the caller to wrap the whole train
    step in `checkify.checkify`. The values themselves follow "propagate" (NaN out).
    """
    ok = jnp.all(jnp.isfinite(rows))
    jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(functools.partial(_report_nonfinite, site=site)))


def nonfinite_sites(clear: bool = True) -> list[str]:
    """Sites reported by the "error" policy since the last call, first report first (waits for pending callbacks)."""
    jax.effects_barrier()
    with _REPORT_LOCK:
        sites = list(dict.fromkeys(_NONFINITE_SITES))
        if clear:
            _NONFINITE_SITES.clear()
    return sites


def raise_if_nonfinite():
    """Raises FloatingPointError naming every site whose "error"-policy check saw NaN/Inf (then clears)."""
    sites = nonfinite_sites()
    if sites:
        raise FloatingPointError(f"non-finite value (NaN/Inf) in a compressed message at site(s) {sites} "
                                 "(codec nonfinite='error')")


def encode(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0) -> Encoded:
    """Encodes each message of `x` with the codec `cfg.kind`.

    Args:
      x: float array [*batch, *shape]; the leading `batch_dims` axes index independent
        messages (e.g. the P chunks of a two-shot all-reduce); each message is flattened
        (after moving channels first if `cfg.group_axis == "token"`) and cut into groups of
        `cfg.group_size`, the last one zero-padded (fp8_tensor: one group per message).
      cfg: a `CodecConfig` of a compressing kind (not "none").
      batch_dims: number of leading message axes.

    Returns:
      An `Encoded` pytree (see its docstring).

    Raises:
      ValueError: if `cfg.kind` is "none", `x` is not floating point, or a message is empty.
    """
    if cfg.kind == "none":
        raise ValueError(f"encode needs a compressing codec (kind 'taco' or another of {CODEC_KINDS[1:]}); "
                         "kind='none' is the exact collective and has no encoding")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"encode needs a floating-point message, got dtype={x.dtype}")
    shape = tuple(x.shape[batch_dims:])
    n = math.prod(shape)
    if n == 0:
        raise ValueError(f"cannot encode an empty message of shape={shape}")
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
        enc_fn, _ = _backend(cfg)
        codes, s, a = enc_fn(xg, cfg, last_count=last_count)
        if cfg.scale_layout == "folded":
            s, a = s / a, None
    else:
        codes, s, a = GROUP_CODECS[cfg.kind][0](xg, cfg)
    if cfg.nonfinite == "error":
        check_finite(rows, cfg.site)
    return Encoded(codes, s, a, shape, np.dtype(x.dtype))


def decode(enc: Encoded, cfg: CodecConfig, dtype=None) -> jax.Array:
    """Decodes an `Encoded` back to [*batch, *enc.shape] in `dtype` (default: the encoded dtype).

    With `cfg.nonfinite` "propagate" or "error" a group that held NaN/±Inf decodes to NaN;
    with "zero" every non-finite output is replaced by 0 (COCCL plugin behaviour). For a
    narrower `dtype` than float32 finite values are clipped to its finite range (a decoded
    float16 never overflows to Inf); float32 output is left alone (it could only overflow for
    inputs within rounding of float32's largest value), which keeps the float32 program, and
    so the training runs, bit-identical to the pre-family codec.
    """
    if cfg.kind == "taco":
        _, dec_fn = _backend(cfg)
        xg = dec_fn(enc.codes, enc.scale, enc.prescale)
    else:
        xg = GROUP_CODECS[cfg.kind][1](enc.codes, enc.scale, enc.prescale, cfg)
    n = math.prod(enc.shape)
    rows = xg.reshape(*xg.shape[:-2], -1)[..., :n]
    if cfg.nonfinite == "zero":
        rows = jnp.where(jnp.isfinite(rows), rows, 0.0)
    dtype = jnp.dtype(dtype or enc.dtype)
    if jnp.finfo(dtype).max < jnp.finfo(jnp.float32).max:  # float16 / bfloat16: never overflow to Inf
        big = np.float32(jnp.finfo(dtype).max)
        rows = jnp.clip(rows, -big, big)  # NaN stays NaN
    return _rows_to_message(rows, enc.shape, cfg).astype(dtype)


def roundtrip(x: jax.Array, cfg: CodecConfig, *, batch_dims: int = 0) -> jax.Array:
    """decode(encode(x)) — what the receiver of one compressed message sees (`x` itself for "none")."""
    if cfg.kind == "none":
        return x
    return decode(encode(x, cfg, batch_dims=batch_dims), cfg)
