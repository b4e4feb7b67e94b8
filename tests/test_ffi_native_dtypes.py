"""The FFI codec reads and writes bfloat16 / float16 messages in their own dtype (no XLA convert),
bit-identical to the float32 path it replaces, and conforms to the reference for such inputs.

1. The compiled HLO of an encode, decode, decode-sum and reduce of a bfloat16 message (group backend
   and "ffi" wire codec) has no convert: the custom calls take and give bfloat16.
2. The kernels' conversions (bfloat16 / float16 <-> float32) equal XLA's convert bit for bit, on every
   16-bit pattern and on a sweep of float32 patterns (NaN payloads, ties, subnormals, overflow).
3. Encoding a 16-bit message equals encoding its float32 widening; decoding to a 16-bit dtype
   equals `clip_to_dtype` + `astype` of the float32 decode; the packed targets likewise; every CPU
   kernel level (AVX-512, AVX2, scalar) alike; and the encode conforms to `reference` on the widened input.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax.codec import TACO, decode, encode, reference
from taco_jax.codec.backends import default_platform
from taco_jax.codec.config import CodecConfig
from taco_jax.codec.dispatch import clip_to_dtype
from taco_jax.kernels import ffi_codec, ffi_wire
from taco_jax.kernels.conformance import assert_conforms, assert_decode_conforms, make_groups

ON_GPU = default_platform() == "cuda"
FFI_REASON = ffi_codec.unavailable_reason(default_platform())
pytestmark = [pytest.mark.fast,
              pytest.mark.skipif(FFI_REASON is not None, reason=f"FFI codec library not available: {FFI_REASON}")]
needs_cpu = pytest.mark.skipif(ON_GPU, reason="the packed targets and `impl` are the CPU library's")

# the CPU kernel levels this machine runs (scalar, AVX2, AVX-512); [auto] where the library is absent
IMPLS = list(ffi_codec.cpu_kernel_levels()[::-1]) or [ffi_codec.IMPL_AUTO]
NARROW = [jnp.bfloat16, jnp.float16]
ids = {"ids": lambda d: jnp.dtype(d).name}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _same(a, b):
    """Bit for bit, NaN payloads included (on GPU, NaN in the same places: XLA's GPU convert need not
    keep a payload)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if ON_GPU and a.dtype.kind == "f":
        nan = np.isnan(a.astype(np.float32))
        np.testing.assert_array_equal(nan, np.isnan(b.astype(np.float32)))
        a, b = a[~nan], b[~nan]
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _clip_cast(y, dtype):
    """What `codec.dispatch.decode` does to float32 values for a narrower message dtype."""
    return clip_to_dtype(y, dtype).astype(dtype)


# --------------------------------------------------------------------------------------
# 1. No convert around the custom calls (compiled HLO, CPU)
# --------------------------------------------------------------------------------------

_CONVERT = re.compile(r"(?<![\w-])convert\(")  # an HLO convert (not bitcast-convert)


def _compiled(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


@needs_cpu
def test_compiled_bf16_codec_has_no_convert_around_the_custom_call():
    cfg = dataclasses.replace(TACO, backend="ffi", wire="ffi")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.bfloat16)
    enc = encode(x, cfg)
    rows4 = ffi_wire.encode_rows(x, cfg, blocks=(0, 4))  # 4 messages [16, 256]
    programs = {
        "encode": (lambda t: encode(t, cfg), x),
        "decode": (lambda e: decode(e, cfg), enc),
        "wire encode": (lambda t: ffi_wire.encode_rows(t, cfg, blocks=(0, 4), per_rank=True), x),
        "wire decode": (lambda r: ffi_wire.decode_rows(r, cfg, (16, 256), jnp.bfloat16, axis=1), rows4),
        "wire decode-sum": (lambda r: ffi_wire.decode_sum_rows(list(r), cfg, (16, 256), jnp.bfloat16), rows4),
        "wire reduce": (lambda r: ffi_wire.reduce_rows(list(r), cfg, (16, 256), jnp.bfloat16, "signal"), rows4),
    }
    for name, (fn, arg) in programs.items():
        hlo = _compiled(fn, arg)
        assert "custom-call" in hlo, name
        assert not _CONVERT.search(hlo), f"{name}: a convert in the compiled HLO:\n{hlo}"
    assert re.search(r'"taco_encode", operand_layout_constraints=\{bf16\[128,128\]', _compiled(*programs["encode"]))
    assert re.search(r'= bf16\[128,128\]\{1,0\} custom-call\(.*"taco_decode"', _compiled(*programs["decode"]))
    # the check sees converts where there are some: the jnp reference casts to float32 and back
    ref = dataclasses.replace(cfg, backend="reference", wire="generic")
    assert _CONVERT.search(_compiled(lambda t: decode(encode(t, ref), ref), x))


# --------------------------------------------------------------------------------------
# 2. The kernels' dtype conversions == XLA's convert
# --------------------------------------------------------------------------------------


def _f32_sweep() -> np.ndarray:
    """Every sign/exponent/top-7-mantissa-bit pattern x low bits around the bfloat16 and float16
    rounding points (ties, +-1), so every tie, subnormal, overflow boundary and NaN payload class."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    return (hi[:, None] | lo[None, :]).reshape(-1).view(np.float32)


@needs_cpu
@pytest.mark.parametrize("impl", [ffi_codec.IMPL_AUTO, ffi_codec.IMPL_SCALAR], ids=["auto", "scalar"])
@pytest.mark.parametrize("dtype", NARROW, **ids)
def test_dtype_conversions_equal_xla_convert(dtype, impl):
    x = jnp.asarray(_f32_sweep())
    xla = jax.jit(lambda t: t.astype(dtype))
    _same(np.asarray(ffi_codec.fp8_cast(x, dtype, impl=impl)), np.asarray(xla(x)))
    clipped = jax.jit(lambda t: _clip_cast(t, dtype))
    _same(np.asarray(ffi_codec.fp8_cast(x, dtype, clamp=1.0, impl=impl)), np.asarray(clipped(x)))
    h = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.dtype(dtype)))
    widen = jax.jit(lambda t: t.astype(jnp.float32))
    _same(np.asarray(ffi_codec.fp8_cast(h, jnp.float32, impl=impl)), np.asarray(widen(h)))


# --------------------------------------------------------------------------------------
# 3. Group backend and packed targets: native == float32 composition
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NARROW, **ids)
@pytest.mark.parametrize(("g", "fmt"), [(32, "e4m3"), (128, "e5m2"), (256, "e4m3"), (512, "e5m2")])
@pytest.mark.cover(2)
def test_native_group_codec_equals_float32_path_and_conforms(g, fmt, dtype):
    cfg = CodecConfig(group_size=g, fmt=fmt)
    x, lc = make_groups(g, n_groups=20, seed=2)
    xd = jnp.asarray(x).astype(dtype)
    x32 = xd.astype(jnp.float32)
    for impl in [ffi_codec.IMPL_AUTO] if ON_GPU else IMPLS:
        got = ffi_codec.encode_groups(xd, cfg, last_count=lc, impl=impl)
        for u, v in zip(got, ffi_codec.encode_groups(x32, cfg, last_count=lc, impl=impl), strict=True):
            _same(np.asarray(u), np.asarray(v))
        codes, s, a = got
        for sa in ((s, a), (s / a, None)):
            y32 = ffi_codec.decode_groups(codes, *sa, impl=impl)
            _same(np.asarray(ffi_codec.decode_groups(codes, *sa, impl=impl, dtype=dtype)),
                  np.asarray(_clip_cast(y32, dtype)))
    assert_conforms(got, reference.encode_groups(x32, cfg, last_count=lc), g)
    assert_decode_conforms(y32, reference.decode_groups(codes, s / a, None), g)


@pytest.mark.parametrize("dtype", NARROW, **ids)
def test_dispatch_round_trip_of_a_16_bit_message_equals_float32_path(dtype):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((37, 100)) * 300.0, dtype)  # partial last group
    for layout, axis in (("dual", "hidden"), ("folded", "token")):
        cfg = CodecConfig(backend="ffi", scale_layout=layout, group_axis=axis)
        enc, enc32 = encode(x, cfg), encode(x.astype(jnp.float32), cfg)
        for u, v in zip(jax.tree.leaves(enc), jax.tree.leaves(enc32), strict=True):
            _same(np.asarray(u), np.asarray(v))
        y = decode(enc, cfg)
        assert y.dtype == dtype
        _same(np.asarray(y), np.asarray(_clip_cast(decode(enc32, cfg, jnp.float32), dtype)))


@needs_cpu
@pytest.mark.parametrize("dtype", NARROW, **ids)
@pytest.mark.parametrize(("layout", "m"), [("dual", 700), ("folded", 1024)])
@pytest.mark.cover(2)
def test_packed_targets_native_equal_float32_composition(layout, m, dtype):
    cfg = dataclasses.replace(TACO, backend="ffi", group_size=128, scale_layout=layout)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, m)) * np.exp(rng.normal(0, 3, (3, m)))).astype(np.float32)
    x[1, 5] = np.nan
    xd = jnp.asarray(x).astype(dtype)
    x32 = xd.astype(jnp.float32)
    outs = []
    for impl in IMPLS:
        rows = ffi_codec.encode_packed(xd, cfg, impl=impl)
        _same(np.asarray(rows), np.asarray(ffi_codec.encode_packed(x32, cfg, impl=impl)))
        dec = ffi_codec.decode_packed(rows, cfg, m, impl=impl, dtype=dtype)
        _same(np.asarray(dec), np.asarray(_clip_cast(ffi_codec.decode_packed(rows, cfg, m, impl=impl), dtype)))
        tot = ffi_codec.decode_sum_packed(list(rows), cfg, m, impl=impl, dtype=dtype)
        tot32 = ffi_codec.decode_sum_packed(list(rows), cfg, m, impl=impl)
        _same(np.asarray(tot), np.asarray(tot32.astype(dtype)))
        red = ffi_codec.reduce_packed(rows, cfg, m, impl=impl, dtype=dtype)
        _same(np.asarray(red), np.asarray(ffi_codec.encode_packed(tot32.astype(dtype), cfg, impl=impl)))
        outs.append((rows, dec, tot, red))
    for other in outs[1:]:  # every kernel level alike
        for u, v in zip(outs[0], other, strict=True):
            _same(np.asarray(u), np.asarray(v))
    # interleaved reads ([outer, P, inner]) and writes (outer) in the message dtype
    xi = xd[:, :512].reshape(2, 3, 256)  # outer 2, P 3, inner 256
    rows_i = ffi_codec.encode_packed(xi, cfg, interleaved=True)
    _same(np.asarray(rows_i), np.asarray(ffi_codec.encode_packed(xi.astype(jnp.float32), cfg, interleaved=True)))
    dec_i = ffi_codec.decode_packed(rows_i, cfg, 512, outer=2, dtype=dtype)
    _same(np.asarray(dec_i), np.asarray(_clip_cast(ffi_codec.decode_packed(rows_i, cfg, 512, outer=2), dtype)))


@needs_cpu
def test_decode_refuses_an_unsupported_output_dtype():
    cfg = dataclasses.replace(TACO, backend="ffi")
    codes, s, a = ffi_codec.encode_groups(jnp.ones((2, 128), jnp.bfloat16), cfg, last_count=128)
    with pytest.raises(ValueError, match="dtype=int8"):
        ffi_codec.decode_groups(codes, s, a, dtype=jnp.int8)
