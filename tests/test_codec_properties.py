"""Property-based tests (hypothesis) of every codec: a derived error bound, non-finite policies, determinism.

Each example draws a codec configuration, a message shape (odd sizes, partial last groups), an
input dtype (float32 / bfloat16 / float16) and a value distribution (scale 10^k for k in
[-30, 30], exact zeros, float32 denormals, ±1e±30 spikes, per-channel outliers); the message is
built from a drawn seed. The default run checks 10 examples of the bound and of `none`, 5 of
the other properties (35 in all, derandomized); the `slow` twins (`make test`, not `make test-fast`) check
250 each, 1,000 in total (~35 s on the idle 2-core machine).

The bound, derived per codec from its kind's registered rounding (`CodecKind.rounding`: FP8 or integer
grid, levels, symmetric, TACO's RMS pre-scale; a kind that declares none fails) by an independent numpy
re-derivation of every scale; u = y / s is the value in code units, y the group after the codec's
transform — identity, WHT, or TACO's WHT(a·x)):

  FP8 with m mantissa bits, R = target range, smallest subnormal 2^-d (e4m3: m=3, d=9;
  e5m2: m=2, d=16): rounding a |u| <= R to FP8 costs <= 2^-(m+1)·|u| + 2^-(d+1); TACO's clamped
  scale s <= 1e6 can leave |u| > R, which saturates to R and costs |u| - R more.
  int8 / int4 (levels -L..L, L = 127 / 7, s = max|y| / L): <= 1/2.   tah (16 levels on
  [min y, max y]): <= 1/2 of the step.
  Error in y = s · (error in u); no transform: element-wise; WHT (orthonormal): the group's L2
  error is the same in y and x; TACO also divides by a. So, per group:
      ‖x' - x‖₂ <= ‖s · b(u)‖₂ / a  (a = 1 without TACO)
  plus float32 slack (WHT matmuls, scale products: 2^-20·G·‖x‖), XLA:CPU's flush of float32
  denormal inputs to zero (<= 2^-126 per element) and rounding of the output to the input dtype
  (2^-8 bf16 / 2^-11 fp16 relative, plus fp16's subnormal half-step 2^-25).
  Regimes made explicit by this bound, not hidden: TACO's a ∈ [1e-3, 1e3] and s ∈ [1e-12, 1e6]
  make groups with values beyond ~1e11 saturate (error ≈ their size) and groups below ~1e-15
  flush to zero (the s·2^-10/a term, ≈ 1e-18 absolute); every codec loses values far below its
  group's absmax (the absolute term s·2^-(d+1) or s/2).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taco_jax.codec import NONE, CodecConfig, codec_kinds, decode, encode, get_kind, roundtrip
from taco_jax.codec.kinds import FP8_BITS, Rounding

pytestmark = pytest.mark.fast

FAST, SLOW = 10, 250  # examples per property: `make test-fast` / `make test` (4 properties -> 1,000)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
#: Message shapes: odd sizes, partial last groups, 1-D to 3-D (a fixed set keeps JAX's compile cache warm).
SHAPES = ((1,), (3,), (31,), (129,), (300,), (1000,), (5, 7), (33, 31), (7, 129), (16, 64), (64, 64), (2, 3, 100),
          (3, 5, 33))
KINDS = codec_kinds()[1:]


# --------------------------------------- strategies ---------------------------------------


@st.composite
def codecs(draw, nonfinite=("propagate", "zero")):
    kind = draw(st.sampled_from(KINDS))
    spec = get_kind(kind)  # the kind's registry entry says which fields apply
    kw = dict(kind=kind, group_size=draw(st.sampled_from(spec.group_sizes)), nonfinite=draw(st.sampled_from(nonfinite)))
    if spec.fp8:
        kw["fmt"] = draw(st.sampled_from(("e4m3", "e5m2")))
    if spec.grouped:
        kw["group_axis"] = draw(st.sampled_from(("hidden", "token")))
    if spec.hadamard == "optional":
        kw["hadamard"] = draw(st.booleans())
    if len(spec.scale_layouts) > 1:
        kw["scale_layout"] = draw(st.sampled_from(spec.scale_layouts))
    return CodecConfig(**kw)


@st.composite
def messages(draw, nonfinite: bool = False):
    """A message (numpy, in its dtype) from drawn shape, dtype, scale, specials and seed."""
    shape = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from(tuple(DTYPES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hi = {"float32": 30, "bfloat16": 30, "float16": 3}[dtype]
    lo = {"float32": -30, "bfloat16": -30, "float16": -4}[dtype]
    k = draw(st.integers(lo, hi))
    x = rng.standard_normal(shape) * 10.0**k
    if len(shape) >= 1 and draw(st.booleans()):  # a few large channels, like TP activations
        x = x * np.exp(rng.normal(0, 2, shape[-1:]))
    specials = [0.0, 1e-40, -1e-40, 1e-30, -1e-30, 1e30, -1e30]
    if dtype == "float16":
        specials = [0.0, 6e-8, -6e-8, 1e-5, 6e4, -6e4]
    frac = draw(st.sampled_from((0.0, 0.01, 0.2, 1.0)))
    mask = rng.random(shape) < frac
    x = np.where(mask, rng.choice(specials, shape), x)
    if nonfinite:
        bad = rng.random(shape) < draw(st.sampled_from((0.001, 0.02, 0.3)))
        x = np.where(bad, rng.choice([np.nan, np.inf, -np.inf], shape), x)
    fmax = float(ml_dtypes.finfo(DTYPES[dtype]).max)
    if not nonfinite:
        x = np.clip(x, -fmax / 2, fmax / 2)
    with np.errstate(over="ignore"):  # float16: ±1e30 specials become ±Inf (non-finite tests only)
        return x.astype(DTYPES[dtype])


# ------------------------------- independent numpy reference -------------------------------


def rows(x: np.ndarray, cfg: CodecConfig) -> np.ndarray:
    """The message in the order groups are cut (TACO spec §2; token axis: channel-major)."""
    if cfg.group_axis == "token" and x.ndim >= 2:
        x = x.reshape(-1, x.shape[-1]).T
    return x.reshape(-1)


def groups(r: np.ndarray, cfg: CodecConfig) -> np.ndarray:
    g = cfg.group_size if get_kind(cfg.kind).grouped else r.size
    n_groups = -(-r.size // g)
    out = np.zeros(n_groups * g, r.dtype)
    out[: r.size] = r
    return out.reshape(n_groups, g)


@functools.cache
def _hadamard(g: int) -> np.ndarray:
    return scipy.linalg.hadamard(g).astype(np.float64) / math.sqrt(g)


def _wht(v):
    return v @ _hadamard(v.shape[-1])


def rounding(cfg: CodecConfig) -> Rounding:
    """The registry's error model of `cfg`'s kind; fails naming a kind that declares none (an
    unregistered kind: `get_kind`'s ValueError)."""
    r = get_kind(cfg.kind).rounding
    if r is None:
        pytest.fail(f"codec kind {cfg.kind!r} declares no `rounding` (taco_jax/codec/kinds.py): its error "
                    "cannot be bounded")
    return r


def group_bounds(xg32: np.ndarray, cfg: CodecConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """(per-group L2 bound [n_groups], per-element bound [n_groups, G] or None) for finite groups,
    from the kind's registered `Rounding`."""
    rnd = rounding(cfg)
    xg = xg32.astype(np.float64)
    g = xg.shape[-1]
    a = np.ones(xg.shape[0])
    if rnd.rms_prescale:  # TACO_SPEC.md §2, in float32 as the spec
        real = np.full(xg.shape[0], g, np.float32)
        with np.errstate(over="ignore"):
            m = np.sum(xg32.astype(np.float32) ** 2, axis=-1, dtype=np.float32) / real
        v = np.maximum(m + np.float32(cfg.lam), np.float32(1e-12))
        a = np.clip(np.float32(cfg.fmax) / np.sqrt(v), 1e-3, 1e3).astype(np.float64)
        y = _wht(a[:, None] * xg)
        s = np.clip(np.maximum(np.abs(y).max(-1), 1e-12) / cfg.target_range, 1e-12, 1e6)
    else:
        y = _wht(xg) if cfg.transforms else xg
        if rnd.grid == "fp8":
            span = np.abs(y).max(-1) / cfg.target_range
        elif rnd.symmetric:
            span = np.abs(y).max(-1) / rnd.levels
        else:
            span = (y.max(-1) - y.min(-1)) / rnd.levels
        s = np.maximum(span, 2.0**-126)
    u = y / s[:, None]
    if rnd.grid == "fp8":
        mbits, d = FP8_BITS[cfg.fmt]
        r = cfg.target_range
        bu = 2.0 ** -(mbits + 1) * np.minimum(np.abs(u), r) + 2.0 ** -(d + 1) + np.maximum(np.abs(u) - r, 0.0)
    else:
        bu = np.full_like(u, 0.5)
    be = s[:, None] * bu / a[:, None]  # per element, in y units / a
    slack = 2.0**-20 * g * (np.linalg.norm(xg, axis=-1) + np.linalg.norm(y, axis=-1) / a)
    ftz = 2.0**-126 * math.sqrt(g) * (1 + (1 / a if rnd.rms_prescale else 1))
    l2 = np.linalg.norm(be, axis=-1) + slack + ftz
    elem = None if cfg.transforms else be + 2.0**-22 * np.abs(xg) + 2.0**-126
    return l2, elem


OUT_EPS = {"float32": (2.0**-24, 2.0**-149), "bfloat16": (2.0**-8, 2.0**-133), "float16": (2.0**-11, 2.0**-25)}


def check_within_bound(x: np.ndarray, out: np.ndarray, cfg: CodecConfig, only_finite_groups=True):
    dt = np.dtype(x.dtype).name
    x32 = x.astype(np.float32)
    xr, yr = rows(x32, cfg), rows(out.astype(np.float32), cfg)
    xg, yg = groups(xr, cfg), groups(yr, cfg)
    n = xr.size
    valid = np.zeros(xg.size, bool)
    valid[:n] = True
    valid = valid.reshape(xg.shape)
    fin = np.all(np.isfinite(xg), axis=-1)
    l2, elem = group_bounds(np.where(np.isfinite(xg), xg, 0), cfg)
    rel, ab = OUT_EPS[dt]
    err = np.where(valid, yg.astype(np.float64) - xg.astype(np.float64), 0.0)
    out_round = rel * (np.linalg.norm(np.where(valid, xg, 0).astype(np.float64), axis=-1) + l2) + ab * math.sqrt(
        xg.shape[-1])
    got = np.linalg.norm(err, axis=-1)
    ok = got <= (l2 + out_round) * (1 + 1e-6)
    bad = np.flatnonzero(fin & ~ok)
    assert bad.size == 0, (f"{cfg.name} {dt} group {bad[:3]}: ‖err‖={got[bad[:3]]} > bound={l2[bad[:3]]} "
                           f"(‖x‖={np.linalg.norm(xg[bad[:3]].astype(np.float64), axis=-1)})")
    if elem is not None:
        e_bound = elem + rel * (np.abs(xg) + elem) + ab
        over = valid & fin[:, None] & (np.abs(err) > e_bound * (1 + 1e-6))
        assert not over.any(), f"{cfg.name} {dt}: element error above bound at {np.argwhere(over)[:3]}"


# ------------------------------------------ properties ------------------------------------------


def _settings(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _prop_bound(cfg, x):
    out = np.asarray(roundtrip(jnp.asarray(x), cfg))
    assert out.dtype == x.dtype and out.shape == x.shape
    assert np.all(np.isfinite(out.astype(np.float32))), f"{cfg.name}: finite input decoded to non-finite"
    check_within_bound(x, out, cfg)


def _prop_zero(cfg, x):
    out = np.asarray(roundtrip(jnp.asarray(x), cfg)).astype(np.float32)
    assert np.all(np.isfinite(out)), f"{cfg.name}: 'zero' left a non-finite value"
    clean = np.where(np.isfinite(x.astype(np.float32)), x, 0).astype(x.dtype)
    want = np.asarray(roundtrip(jnp.asarray(clean), cfg)).astype(np.float32)
    np.testing.assert_array_equal(out, want)  # exactly the message with NaN/Inf replaced by 0


def _prop_propagate(cfg, x):
    out = np.asarray(roundtrip(jnp.asarray(x), cfg)).astype(np.float32)
    x32 = x.astype(np.float32)
    xr, yr = rows(x32, cfg), rows(out, cfg)
    xg, yg = groups(xr, cfg), groups(yr, cfg)
    n = xr.size
    bad = ~np.all(np.isfinite(xg), axis=-1)
    valid = (np.arange(xg.size) < n).reshape(xg.shape)
    assert np.all(np.isnan(yg[bad][valid[bad]])), f"{cfg.name}: a non-finite group decoded to numbers"
    assert np.all(np.isfinite(yg[~bad][valid[~bad]])), f"{cfg.name}: a finite group decoded to non-finite"
    assert np.all(np.isnan(out[~np.isfinite(x32)])), "propagate turned a NaN/Inf into a number"
    if (~bad).any():  # the finite groups are untouched by their neighbours' NaN
        clean = np.where(np.isfinite(x32), x32, 0).astype(x.dtype)
        ref = rows(np.asarray(roundtrip(jnp.asarray(clean), cfg)).astype(np.float32), cfg)
        ref = groups(ref, cfg)
        np.testing.assert_array_equal(yg[~bad], ref[~bad])


def _prop_deterministic(cfg, x):
    a = np.asarray(roundtrip(jnp.asarray(x), cfg))
    b = np.asarray(roundtrip(jnp.asarray(x.copy()), cfg))
    np.testing.assert_array_equal(a, b)
    enc1, enc2 = encode(jnp.asarray(x), cfg), encode(jnp.asarray(x), cfg)
    np.testing.assert_array_equal(np.asarray(enc1.codes).view(np.uint8), np.asarray(enc2.codes).view(np.uint8))
    np.testing.assert_array_equal(decode(enc1, cfg), a)


def _prop_none(x):
    out = roundtrip(jnp.asarray(x), NONE)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), x.view(np.uint8))  # bit-exact, NaN payloads too


def _make(prop, n, strat_cfg, strat_x, name):
    @_settings(n)
    @given(cfg=strat_cfg, x=strat_x)
    def test(cfg, x):
        prop(cfg, x)

    test.__name__ = name
    return test


test_error_bound = _make(_prop_bound, FAST, codecs(), messages(), "test_error_bound")
test_propagate_never_turns_nan_into_number = _make(_prop_propagate, FAST // 2, codecs(("propagate",)),
                                                   messages(nonfinite=True), "test_propagate")
test_zero_policy_replaces_nonfinite_by_zero = _make(_prop_zero, FAST // 2, codecs(("zero",)),
                                                    messages(nonfinite=True), "test_zero")
test_deterministic = _make(_prop_deterministic, FAST // 2, codecs(), messages(), "test_deterministic")


@_settings(FAST)
@given(x=messages(nonfinite=True))
def test_none_is_bit_exact(x):
    _prop_none(x)


slow = pytest.mark.slow
test_error_bound_slow = slow(_make(_prop_bound, SLOW, codecs(), messages(), "test_error_bound_slow"))
test_propagate_slow = slow(_make(_prop_propagate, SLOW, codecs(("propagate",)), messages(nonfinite=True),
                                 "test_propagate_slow"))
test_zero_slow = slow(_make(_prop_zero, SLOW, codecs(("zero",)), messages(nonfinite=True), "test_zero_slow"))
test_deterministic_slow = slow(_make(_prop_deterministic, SLOW, codecs(), messages(), "test_deterministic_slow"))
