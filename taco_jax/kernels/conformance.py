"""The conformance rule of `taco_jax.kernels` as a check (a backend against `reference` on the same inputs), shared
by the tests and the GPU check. Every check raises AssertionError naming what differs and by how much."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from taco_jax.codec import reference
from taco_jax.codec.backends import get_backend
from taco_jax.codec.config import CodecConfig


def make_groups(g: int, n_groups: int = 24, batch: int = 2, seed: int = 0, last_count: int | None = None):
    """(x float32 [batch, n_groups, g], last_count) with varied scales, outlier channels, a zero
    group, a NaN and an Inf group, huge and tiny groups, and a last group zero-padded past
    `last_count` (default g // 3). Raises ValueError if batch * n_groups < 9."""
    if batch * n_groups < 9:
        raise ValueError(f"make_groups needs batch * n_groups >= 9, got {batch} * {n_groups}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, n_groups, g)).astype(np.float32)
    x *= rng.lognormal(0.0, 2.0, (batch, n_groups, 1)).astype(np.float32)
    flat = x.reshape(-1, g)  # a view: special groups at flat positions 1..7
    flat[1, rng.integers(0, g, 3)] *= 50.0  # outlier channels
    flat[2] = 0.0  # all-zero group
    flat[3] *= np.float32(1e30)  # sum of squares overflows -> a = 1e-3
    flat[4] *= np.float32(1e-30)  # tiny
    flat[5, 5] = np.nan
    flat[6, 7] = np.inf
    flat[7, 1] = -np.inf
    last_count = g // 3 if last_count is None else last_count
    x[:, -1, last_count:] = 0.0
    return x, last_count


def ordinal(codes: np.ndarray) -> np.ndarray:
    """FP8 codes (any 1-byte dtype) as signed step counts, int32 of the same shape (sign-magnitude
    -> integer; +0 and -0 both 0)."""
    u = np.asarray(codes).view(np.uint8).astype(np.int32)
    return np.where(u & 0x80, -(u & 0x7F), u & 0x7F)


def assert_conforms(got, want, g: int, r: float = 448.0, max_code_frac: float = 1e-3) -> None:
    """The conformance rule of `taco_jax.kernels` for encode outputs: `got` and `want` are
    (codes [..., G] FP8, s [...] float32, a [...] float32) of a backend and of `reference`; `r` is
    the format's largest finite value (448 for E4M3). Raises AssertionError naming the difference."""
    codes, s, a = (np.asarray(t) for t in got)
    codes_r, s_r, a_r = (np.asarray(t) for t in want)
    if codes.dtype != codes_r.dtype or codes.shape != codes_r.shape:
        raise AssertionError(f"codes {codes.dtype}{list(codes.shape)}, reference {codes_r.dtype}{list(codes_r.shape)}")
    if s.shape != s_r.shape or a.shape != a_r.shape:
        raise AssertionError(f"scales s{list(s.shape)} a{list(a.shape)}, "
                             f"reference s{list(s_r.shape)} a{list(a_r.shape)}")
    finite = np.isfinite(s_r)
    np.testing.assert_array_equal(np.isnan(s), ~finite, err_msg="non-finite groups must (only) get s = NaN")
    rtol = 2.0**-23 * g
    np.testing.assert_allclose(s[finite], s_r[finite], rtol=rtol, atol=0)
    np.testing.assert_allclose(a, a_r, rtol=rtol, atol=0)  # NaN where the reference has NaN
    steps = np.abs(ordinal(codes) - ordinal(codes_r))[finite]
    values = np.abs(codes.astype(np.float32) - codes_r.astype(np.float32))[finite]
    ok = (steps <= 1) | (values <= 2.0**-23 * g * r)  # one FP8 step, or reordering noise near 0
    if not ok.all():
        raise AssertionError(f"codes differ by up to {steps.max()} steps / {values[~ok].max()} in value")
    frac = np.mean(steps > 0)
    if frac > max_code_frac:
        raise AssertionError(f"{frac:.2e} of codes differ (at most {max_code_frac:g} may)")


def step_codes(codes, frac: float, seed: int = 0, *, steps: int = 1):
    """`codes` (FP8 [..., G], numpy or jax) with a fraction `frac` of them moved `steps` FP8 steps up or down
    (clamped to the largest finite code), at positions and signs fixed by `seed`: the deviation the contract allows,
    made on purpose. Traceable (jnp); same dtype and shape. Raises ValueError for `frac` outside [0, 1]."""
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"step_codes: frac={frac} must be in [0, 1]")
    import jax  # noqa: PLC0415

    top = int(np.max(ordinal(np.array(ml_dtypes.finfo(np.dtype(codes.dtype)).max, codes.dtype))))
    u = jax.lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
    idx = jnp.arange(u.size, dtype=jnp.uint32).reshape(u.shape)
    h = (idx + jnp.uint32(seed * 7919)) * jnp.uint32(2654435761)  # Knuth's multiplicative hash
    h = h ^ (h >> 15)
    move = jnp.where(h < jnp.uint32(min(int(frac * 2.0**32), 2**32 - 1)), jnp.where(h & 1, steps, -steps), 0)
    o = jnp.clip(jnp.where(u & 0x80, -(u & 0x7F), u & 0x7F) + move, -top, top)
    u = jnp.where(o < 0, 0x80 | -o, o).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(u, codes.dtype)


def check_messages(name: str, messages, cfg: CodecConfig, *, max_code_frac: float = 1e-3) -> float:
    """Backend `name`'s encode of real messages against `reference`'s (`assert_conforms`), and the
    decode of the same codes (`assert_decode_conforms`). messages: float32 arrays [..., n] whose
    element count is a multiple of cfg.group_size (each cut into contiguous groups, spec section 2).
    Returns the fraction of codes that differ (at most `max_code_frac`). Raises AssertionError
    naming the first message that does not conform, ValueError for a size that is not whole groups."""
    import taco_jax.kernels  # noqa: F401, PLC0415  (the backends register on import)

    g = cfg.group_size
    enc, dec = get_backend(name)
    flipped = total = 0
    for i, m in enumerate(messages):
        m = np.asarray(m, np.float32)
        if m.size % g:
            raise ValueError(f"check_messages: message {i} of shape {m.shape} is not whole groups of {g}")
        xg = jnp.asarray(m.reshape(-1, g))
        got = enc(xg, cfg, last_count=g)
        want = reference.encode_groups(xg, cfg, last_count=g)
        try:
            assert_conforms(got, want, g, r=cfg.target_range, max_code_frac=max_code_frac)
            codes, s, a = got
            assert_decode_conforms(dec(codes, s, a), reference.decode_groups(codes, s, a), g)
        except AssertionError as e:
            raise AssertionError(f"message {i} {list(m.shape)}: {e}") from None
        flipped += int(np.sum(ordinal(got[0]) != ordinal(want[0])))
        total += m.size
    return flipped / max(total, 1)


def dtype_ulp(values: np.ndarray, dtype) -> np.ndarray:
    """One unit in the last place of `dtype` (float32, bfloat16, float16) at each of `values`
    (float32 array of the same shape; subnormal spacing below the smallest normal)."""
    fi = ml_dtypes.finfo(np.dtype(dtype))
    e = np.floor(np.log2(np.maximum(np.abs(values).astype(np.float64), float(fi.smallest_normal))))
    return (np.exp2(e) * float(fi.eps)).astype(np.float32)


def assert_decode_conforms(got, want, g: int, *, dtype=None, ref_max=None) -> None:
    """Decoded values [..., G] of a backend (`got`) against `reference` (`want`, float32): NaN in the
    same places; elsewhere within 2^-23 * G * max|want| of the group (or `ref_max` [..., 1], e.g.
    the sum of the ranks' maxima for a decode-sum). With a narrower output `dtype`, `want` is
    clipped to its range and one ulp of dtype is allowed on top. Raises AssertionError."""
    got, want = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want).any(axis=-1)
    if ref_max is None:
        ref_max = np.max(np.abs(want[ok]), axis=-1, keepdims=True)
    else:
        ref_max = np.broadcast_to(np.asarray(ref_max, np.float32), want.shape[:-1] + (1,))[ok]
    tol = 2.0**-23 * g * ref_max
    w = want[ok]
    if dtype is not None and np.dtype(dtype) != np.float32:
        big = float(ml_dtypes.finfo(np.dtype(dtype)).max)
        w = np.clip(w, -big, big)
        tol = tol + dtype_ulp(w, dtype)
    err = np.abs(got[ok] - w)
    if not np.all(err <= tol):
        raise AssertionError(f"decoded values differ by up to {np.max(err - tol):.3g} beyond 2^-23 * G * max|x|"
                             + (f" + 1 ulp of {np.dtype(dtype).name}" if dtype is not None else ""))


def check_backend(name: str, g: int, fmt: str, **data_kw) -> None:
    """Backend `name` (registered in `taco_jax.kernels`) against `reference` for format `fmt`
    ("e4m3" / "e5m2") and group size `g`, on `make_groups(g, **data_kw)`: encode conforms, and
    decoding the same codes (dual and folded scale layout) conforms. Raises AssertionError, or
    the backend's own error (e.g. ValueError for a backend that is not available)."""
    import taco_jax.kernels  # noqa: F401, PLC0415  (the backends register on import)

    cfg = CodecConfig(fmt=fmt, group_size=g)
    x, last_count = make_groups(g, **data_kw)
    enc, dec = get_backend(name)
    got = enc(jnp.asarray(x), cfg, last_count=last_count)
    assert_conforms(got, reference.encode_groups(jnp.asarray(x), cfg, last_count=last_count), g)
    codes, s, a = got
    assert_decode_conforms(dec(codes, s, a), reference.decode_groups(codes, s, a), g)
    assert_decode_conforms(dec(codes, s / a, None), reference.decode_groups(codes, s / a, None), g)
