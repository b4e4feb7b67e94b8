"""The TACO codec against an independent numpy re-derivation of TACO_SPEC §2."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.linalg

from taco_jax.codec import NONE, TACO, CodecConfig, decode, encode, roundtrip

pytestmark = pytest.mark.fast

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def spec_encode(x: np.ndarray, fmt: str, g: int, lam=1e-6, r=448.0):
    """TACO_SPEC §2 step by step, one group at a time, in float32 numpy."""
    f = float(ml_dtypes.finfo(FP8[fmt]).max)
    h = scipy.linalg.hadamard(g).astype(np.float32)
    flat = x.astype(np.float32).reshape(-1)
    codes, ss, aa = [], [], []
    for start in range(0, flat.size, g):
        real = flat[start : start + g]
        grp = np.zeros(g, np.float32)
        grp[: real.size] = real  # zero-padded last group
        m = np.float32(np.sum(real.astype(np.float64) ** 2) / real.size)  # mean over the real count
        v = max(m + np.float32(lam), np.float32(1e-12))
        a = np.float32(np.clip(f / np.sqrt(v), 1e-3, 1e3))
        y = (h @ (a * grp).astype(np.float64) / math.sqrt(g)).astype(np.float32)
        s = np.float32(np.clip(max(np.abs(y).max(), 1e-12) / r, 1e-12, 1e6))
        q = np.clip(y / s, -r, r).astype(FP8[fmt])
        codes.append(q), ss.append(s), aa.append(a)
    return np.stack(codes), np.array(ss, np.float32), np.array(aa, np.float32)


def spec_decode(codes, s, a, n):
    g = codes.shape[-1]
    h = scipy.linalg.hadamard(g)
    y = codes.astype(np.float64) * s[:, None]
    x = (y @ h) / math.sqrt(g) / np.maximum(a, 1e-12)[:, None]
    return x.reshape(-1)[:n]


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    # heavy-ish tails and a few large channels, like TP activations
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 1, shape[-1:])).astype(np.float32)
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("g,shape", [(128, (16, 256)), (32, (7, 45)), (512, (3, 200)), (64, (1000,))])
def test_encode_matches_spec(fmt, g, shape):
    x = _data(shape)
    cfg = CodecConfig(fmt=fmt, group_size=g)
    enc = encode(jnp.asarray(x), cfg)
    codes, s, a = spec_encode(x, fmt, g)
    np.testing.assert_allclose(np.asarray(enc.prescale), a, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(enc.scale), s, rtol=2e-6)
    got = np.asarray(enc.codes).astype(np.float32)
    want = codes.astype(np.float32)
    # Codes are identical except where float32 summation order moves y/s across a rounding tie:
    # then they differ by exactly one FP8 step. Allow ≤ 0.2% such codes, none further apart.
    diff = got != want
    assert diff.mean() <= 2e-3, f"{diff.mean():.4%} of codes differ"
    spacing = np.abs(np.asarray(want, FP8[fmt]).astype(np.float32)) * 2.0 ** -(3 if fmt == "e4m3" else 2) + 1e-9
    assert np.all(np.abs(got - want)[diff] <= spacing[diff] * 1.01 + 2.0**-9)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_decode_matches_spec(fmt):
    x = _data((5, 300), seed=1)  # 1500 = 11 groups of 128 + a partial group of 92
    cfg = CodecConfig(fmt=fmt)
    enc = encode(jnp.asarray(x), cfg)
    want = spec_decode(np.asarray(enc.codes), np.asarray(enc.scale), np.asarray(enc.prescale), x.size)
    got = np.asarray(decode(enc, cfg)).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt,eps", [("e4m3", 2.0**-4), ("e5m2", 2.0**-3)])
@pytest.mark.parametrize("layout", ["dual", "folded"])
def test_roundtrip_error_bound(fmt, eps, layout):
    """Per group, ||x' - x|| <= (2^-(m+1) + 2^-10·sqrt(G)/R)·||x|| (m mantissa bits; WHT orthonormal)."""
    x = _data((64, 512), seed=2)
    cfg = CodecConfig(fmt=fmt, scale_layout=layout)
    err = np.asarray(roundtrip(jnp.asarray(x), cfg)) - x
    bound = eps + 2.0**-10 * math.sqrt(128) / 448 + 1e-5
    per_group = np.linalg.norm(err.reshape(-1, 128), axis=1) / np.linalg.norm(x.reshape(-1, 128), axis=1)
    assert per_group.max() <= bound
    assert per_group.mean() < bound / 2  # typical error is well inside the worst case


def test_folded_layout_sends_one_scale_and_decodes_close_to_dual():
    x = jnp.asarray(_data((32, 256), seed=3))
    dual, folded = CodecConfig(), CodecConfig(scale_layout="folded")
    e = encode(x, folded)
    assert e.prescale is None and e.nbytes == x.size + 4 * x.size // 128
    np.testing.assert_allclose(decode(e, folded), decode(encode(x, dual), dual), rtol=1e-5, atol=1e-5)


def test_token_axis_groups_one_channel_across_tokens():
    x = jnp.asarray(_data((256, 8), seed=4))
    cfg = CodecConfig(group_axis="token")
    enc = encode(x, cfg)
    # group j holds channel j's 128 first tokens: its adaptive scale comes from that channel's RMS
    ch0 = np.asarray(x)[:128, 0]
    want_a = np.clip(448 / np.sqrt(np.mean(ch0**2) + 1e-6), 1e-3, 1e3)
    np.testing.assert_allclose(enc.prescale[0], want_a, rtol=1e-5)
    assert decode(enc, cfg).shape == x.shape


def test_wire_bytes_per_element():
    assert TACO.wire_bytes_per_element() == 1.0625
    assert CodecConfig(scale_layout="folded").wire_bytes_per_element() == 1.03125
    assert NONE.wire_bytes_per_element(jnp.bfloat16) == 2.0
    x = jnp.ones((128, 128))
    assert encode(x, TACO).nbytes == x.size * 1.0625


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_nonfinite_propagates_by_default(bad):
    x = jnp.asarray(_data((4, 256), seed=5)).at[1, 3].set(bad)
    y = np.asarray(roundtrip(x, TACO))
    group = y.reshape(-1, 128)[2]  # element (1, 3) is in group 2
    assert np.all(np.isnan(group)), "a NaN/Inf in must stay non-finite out"
    others = np.delete(y.reshape(-1, 128), 2, axis=0)
    assert np.all(np.isfinite(others)), "other groups are untouched"


def test_nonfinite_zero_policy_is_explicit():
    x = jnp.asarray(_data((2, 128), seed=6)).at[0, 0].set(jnp.nan)
    y = np.asarray(roundtrip(x, CodecConfig(nonfinite="zero")))
    assert np.all(np.isfinite(y))
    assert abs(y[0, 0]) < 0.1 * np.sqrt(np.mean(y**2))  # encoded as 0 (up to the group's quantization error)


def test_zeros_and_dtypes_roundtrip():
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        z = jnp.zeros((3, 100), dt)
        out = roundtrip(z, TACO)
        assert out.dtype == dt and not np.any(np.asarray(out, np.float32))


def test_encode_is_deterministic_and_jittable():
    x = jnp.asarray(_data((8, 384), seed=7))
    f = jax.jit(lambda v: roundtrip(v, TACO))
    np.testing.assert_array_equal(f(x), f(x + 0))  # bitwise repeatable
    np.testing.assert_allclose(f(x), roundtrip(x, TACO), rtol=1e-5, atol=1e-4)  # eager = jit up to rare code ties


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=96), "group_size=96"),
        (dict(fmt="e3m4"), "fmt='e3m4'"),
        (dict(kind="int3"), "kind='int3'"),
        (dict(target_range=500.0), "target_range=500.0"),
        (dict(scale_layout="triple"), "scale_layout"),
        (dict(nonfinite="ignore"), "nonfinite='ignore'"),
        (dict(group_axis="batch"), "group_axis='batch'"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        CodecConfig(**kwargs)


def test_bad_messages_raise():
    with pytest.raises(ValueError, match="floating-point"):
        encode(jnp.ones((4,), jnp.int32), TACO)
    with pytest.raises(ValueError, match="kind 'taco'"):
        encode(jnp.ones((4,)), NONE)


def test_spec_constants_agree_with_the_cpp_header_and_ml_dtypes():
    """custom_calls/taco_constants.h carries the names and values of taco_jax.codec.constants."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from taco_jax.codec import constants  # noqa: PLC0415
    from taco_jax.codec.config import fp8_max  # noqa: PLC0415

    header = (Path(__file__).resolve().parents[1] / "custom_calls" / "taco_constants.h").read_text()
    found = dict(re.findall(r"constexpr\s+(?:float|int)\s+(\w+)\s*=\s*([-+0-9.eE]+)f?\s*;", header))
    want = {"EPS", "ADAPTIVE_SCALE_MIN", "ADAPTIVE_SCALE_MAX", "SCALE_MAX", "E4M3_MAX", "E5M2_MAX",
            "MIN_GROUP_SIZE", "MAX_GROUP_SIZE"}
    assert set(found) == want, sorted(set(found) ^ want)
    for name, text in found.items():
        assert np.float32(float(text)) == np.float32(getattr(constants, name)), name
    assert (constants.E4M3_MAX, constants.E5M2_MAX) == (fp8_max("e4m3"), fp8_max("e5m2"))
    lo, hi = constants.MIN_GROUP_SIZE, constants.MAX_GROUP_SIZE
    assert constants.GROUP_SIZES == tuple(2**k for k in range(lo.bit_length() - 1, hi.bit_length()))
