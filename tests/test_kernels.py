"""Codec kernel backends conform to the reference (rule in `taco_jax.kernels`); FP8 casts match ml_dtypes."""

import dataclasses
import os
import warnings

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # conftest normally sets it
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from taco_jax import kernels  # noqa: E402
from taco_jax.codec import backends as codec_backends  # noqa: E402
from taco_jax.codec import decode, encode, reference  # noqa: E402
from taco_jax.codec.backends import default_platform  # noqa: E402
from taco_jax.codec.config import CodecConfig  # noqa: E402
from taco_jax.codec.vma import vma_of  # noqa: E402
from taco_jax.collectives.policy import CommPolicy  # noqa: E402
from taco_jax.kernels import ffi_codec  # noqa: E402
from taco_jax.kernels.conformance import (  # noqa: E402
    assert_conforms,
    assert_decode_conforms,
    check_backend,
    make_groups,
)

pytestmark = pytest.mark.fast

ON_GPU = default_platform() == "cuda"
FFI_REASON = ffi_codec.unavailable_reason(default_platform())
needs_ffi = pytest.mark.skipif(FFI_REASON is not None, reason=f"FFI codec library not available: {FFI_REASON}")
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (jax's default platform is not cuda)")

CODE_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


# --------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------


def test_available_backends_on_cpu_include_reference_pallas_auto():
    avail = kernels.available_backends("cpu")
    assert {"reference", "pallas", "auto"} <= set(avail)
    assert "triton" not in avail
    assert ("ffi" in avail) == (ffi_codec.unavailable_reason("cpu") is None)


def test_unavailable_backend_named_explicitly_raises_listing_available():
    with pytest.raises(ValueError, match=r"not available on cpu.*Available: \("):
        kernels.resolve("triton", "cpu")


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown codec backend"):
        kernels.resolve("cuda-magic")


def test_unknown_backend_name_rejected_by_codec_config():
    with pytest.raises(ValueError, match="backend='cuda-magic'"):
        CodecConfig(backend="cuda-magic")


@pytest.mark.skipif(ON_GPU, reason="the interpreter warning is for CPU")
def test_pallas_on_cpu_warns_it_is_the_interpreter():
    kernels._warn_pallas_interpret.cache_clear()
    with pytest.warns(UserWarning, match="Pallas interpreter"):
        assert kernels.resolve("pallas", "cpu") == "pallas"


def test_auto_picks_ffi_on_cpu_when_built_else_reference():
    want = "ffi" if ffi_codec.unavailable_reason("cpu") is None else "reference"
    assert kernels.resolve("auto", "cpu") == want


def test_reference_backend_is_the_reference():
    assert codec_backends.get_backend("reference") == (reference.encode_groups, reference.decode_groups)


def test_resolve_codec_makes_auto_concrete_and_names_reference_for_other_kinds():
    got = kernels.resolve_codec(CodecConfig(backend="auto"), "cpu")
    assert got.backend == kernels.resolve("auto", "cpu") != "auto"
    int8 = CodecConfig(kind="int8", backend="auto")  # its group math is always the jnp reference
    assert kernels.resolve_codec(int8, "cpu") == dataclasses.replace(int8, backend="reference", wire="generic",
                                                                     transport="xla")


def test_policy_resolution_names_the_site_whose_backend_cannot_run():
    policy = CommPolicy(ar_bwd=CodecConfig(backend="triton"))
    with pytest.raises(ValueError, match="site ar_bwd: codec backend 'triton' is not available on cpu"):
        policy.resolve_backends("cpu")
    with pytest.raises(ValueError, match="site ar_fwd: backend='pallas'.*8-device"):
        CommPolicy.taco(CodecConfig(backend="pallas")).resolve_backends("cpu", n_devices=8)


def test_auto_is_the_default_and_resolves_at_trace_time_in_a_library_call():
    """`CodecConfig()` (TACO) defaults to "auto"; `encode` called directly (no trainer, no
    `resolve_codec`) runs what `resolve("auto")` names here, and gives the same wire buffers as
    that concrete backend."""
    assert CodecConfig().backend == "auto"
    assert codec_backends.resolve_auto() == kernels.resolve("auto")
    assert codec_backends.get_backend("auto") == codec_backends.get_backend(kernels.resolve("auto"))
    x = jax.random.normal(jax.random.key(0), (4, 256))
    got = encode(x, CodecConfig())
    want = encode(x, CodecConfig(backend=kernels.resolve("auto")))
    np.testing.assert_array_equal(np.asarray(got.codes, np.float32), np.asarray(want.codes, np.float32))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))


def test_auto_without_a_chooser_is_reference(monkeypatch):
    monkeypatch.setattr(codec_backends, "_RESOLVER", [])
    assert codec_backends.resolve_auto() == "reference"


def test_auto_warns_once_when_ffi_is_not_built(monkeypatch):
    monkeypatch.setattr(ffi_codec, "unavailable_reason", lambda platform="cpu": "libtaco_ffi.so not built")
    kernels._warn_auto_fallback.cache_clear()
    with pytest.warns(UserWarning, match=r"'auto' on cpu.*not built.*using 'reference'.*make -C custom_calls"):
        assert kernels.resolve("auto", "cpu") == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.resolve("auto", "cpu") == "reference"  # once per process
    kernels._warn_auto_fallback.cache_clear()


def test_encode_refuses_an_unregistered_backend():
    with pytest.raises(ValueError, match="'nosuch' is not registered"):
        codec_backends.get_backend("nosuch")


@pytest.mark.skipif(FFI_REASON is not None or len(jax.devices()) < 8, reason="needs the FFI library and 8 devices")
@pytest.mark.parametrize(("comm", "backend"), [("none", "ffi"), ("taco", "auto")])
@pytest.mark.slow
def test_every_site_of_the_train_step_runs_the_requested_backend(monkeypatch, comm, backend):
    """The codecs of every site (tensor, data and stage axes) in the traced 3D train step run the
    backend asked for (`auto` resolved before tracing). Caught the DP/PP codecs running `reference`
    under `--backend ffi` (TrainConfig.axis_codec dropped the backend)."""
    from taco_jax.train.config import TrainConfig  # noqa: PLC0415
    from taco_jax.train.step import make_trainer, shard_batch  # noqa: PLC0415

    seen = []

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)

        return wrapped

    for name in ("reference", "ffi"):
        real = codec_backends.get_backend(name)
        monkeypatch.setitem(codec_backends._LOADED, name, codec_backends.GroupBackend(
            recording(name, real.encode_groups), recording(name, real.decode_groups)))
    for fn in ("encode_packed", "decode_packed", "decode_sum_packed", "reduce_packed", "reduce_hadamard_packed"):
        monkeypatch.setattr(ffi_codec, fn, recording("ffi", getattr(ffi_codec, fn)))  # the "ffi" wire codec
    cfg = TrainConfig.from_flags(comm=comm, dp_comm="taco", pp_comm="taco", backend=backend,
                                 mesh="data=2,stage=2,tensor=2", microbatches=2, model="gpt2-tiny", vocab_size=512,
                                 batch_size=8, seq_len=32)
    tr = make_trainer(cfg)
    params, opt = tr.init()
    x = np.zeros((8, 32), np.int32)
    tr.train_step.lower(params, opt, *shard_batch(tr, x, x))
    assert seen and set(seen) == {kernels.resolve(backend)}, sorted(set(seen))


def test_pallas_encode_exports_for_cuda_from_a_cpu_host():
    """Interpret mode follows the lowering platform: a CUDA export lowers the Triton kernels."""
    enc, dec = codec_backends.get_backend("pallas")
    cfg = CodecConfig(group_size=64)

    def f(x):
        codes, s, a = enc(x, cfg, last_count=64)
        return dec(codes, s, a)

    triton = "__gpu$xla.gpu.triton"
    exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(jnp.ones((4, 64)))
    assert exp.platforms == ("cuda",)
    assert exp.mlir_module().count(triton) == 2  # encode and decode


# --------------------------------------------------------------------------------------
# FP8 conversions of the C++ handlers == ml_dtypes, bit for bit
# --------------------------------------------------------------------------------------


def _float_sweep() -> np.ndarray:
    """All sign/exponent/top-11-mantissa-bit patterns x low-bit patterns: every RNE tie of both
    formats (normal and subnormal), values just around them, Inf and NaN payloads."""
    hi = np.arange(1 << 20, dtype=np.uint32) << 12
    lo = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)
    return (hi[:, None] | lo[None, :]).reshape(-1).view(np.float32)


@needs_ffi
@pytest.mark.parametrize("impl", [ffi_codec.IMPL_AUTO, ffi_codec.IMPL_SCALAR], ids=["auto", "scalar"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_to_f32_all_256_codes_match_ml_dtypes(fmt, impl):
    codes = np.arange(256, dtype=np.uint8).view(CODE_DTYPES[fmt])
    got = np.asarray(ffi_codec.fp8_cast(jnp.asarray(codes), jnp.float32, impl=impl))
    want = codes.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@needs_ffi
@pytest.mark.parametrize("impl", [ffi_codec.IMPL_AUTO, ffi_codec.IMPL_SCALAR], ids=["auto", "scalar"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_f32_to_fp8_matches_ml_dtypes_on_all_ties_and_specials(fmt, impl):
    x = _float_sweep()
    got = np.asarray(ffi_codec.fp8_cast(jnp.asarray(x), CODE_DTYPES[fmt], impl=impl)).view(np.uint8)
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = x.astype(CODE_DTYPES[fmt]).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"


@needs_ffi
@pytest.mark.parametrize("impl", [ffi_codec.IMPL_AUTO, ffi_codec.IMPL_SCALAR], ids=["auto", "scalar"])
@pytest.mark.parametrize(("fmt", "r"), [("e4m3", 448.0), ("e4m3", 300.0), ("e5m2", 57344.0), ("e5m2", 448.0)])
def test_codec_quantizer_is_clamp_then_ml_dtypes(fmt, r, impl):
    x = _float_sweep()
    x = x[~np.isnan(x)]  # the codec never quantizes NaN (such groups are handled apart)
    got = np.asarray(ffi_codec.fp8_cast(jnp.asarray(x), CODE_DTYPES[fmt], clamp=r, impl=impl)).view(np.uint8)
    want = np.clip(x, -np.float32(r), np.float32(r)).astype(CODE_DTYPES[fmt]).view(np.uint8)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"


# --------------------------------------------------------------------------------------
# Conformance of the group codec
# --------------------------------------------------------------------------------------


@needs_ffi
@pytest.mark.parametrize("g", [32, 64, 128, 256, 512])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.cover(2)
def test_ffi_conforms_to_reference(g, fmt):
    check_backend("ffi", g, fmt)


@needs_ffi
@pytest.mark.parametrize("impl", [-1, 4, 7])
def test_ffi_kernel_level_outside_0_to_3_is_refused(impl):
    """An `impl` that is no CPU kernel level is refused naming it, before any call is built."""
    xg = jnp.ones((4, 32), jnp.float32)
    with pytest.raises(ValueError, match=rf"impl={impl} is not a CPU kernel level"):
        ffi_codec.encode_groups(xg, CodecConfig(group_size=32), last_count=32, impl=impl)


@needs_ffi
@pytest.mark.parametrize(("g", "fmt"), [(32, "e4m3"), (128, "e4m3"), (128, "e5m2"), (256, "e5m2"), (512, "e4m3")])
def test_ffi_scalar_and_vector_kernels_are_bit_identical(g, fmt):
    """Every kernel level the CPU has (scalar, AVX2, AVX-512) gives the same bits; 81 groups (an odd
    count: the AVX-512 encoder's last pair holds one group) with the special groups of make_groups."""
    cfg = CodecConfig(group_size=g, fmt=fmt)
    x, last_count = make_groups(g, n_groups=27, batch=3, seed=1)
    levels = ffi_codec.cpu_kernel_levels()[::-1]  # the highest first: the one `auto` runs
    out = [ffi_codec.encode_groups(jnp.asarray(x), cfg, last_count=last_count, impl=i) for i in levels]
    for i, other in zip(levels[1:], out[1:], strict=True):
        for u, v in zip(out[0], other, strict=True):
            np.testing.assert_array_equal(
                np.asarray(u).view(np.uint8) if u.dtype.itemsize == 1 else np.asarray(u),
                np.asarray(v).view(np.uint8) if v.dtype.itemsize == 1 else np.asarray(v),
                err_msg=f"impl={i}",
            )
    codes, s, a = out[0]
    dec = [np.asarray(ffi_codec.decode_groups(codes, s, a, impl=i)) for i in levels]
    for i, d in zip(levels[1:], dec[1:], strict=True):
        np.testing.assert_array_equal(dec[0], d, err_msg=f"impl={i}")


@needs_ffi
@pytest.mark.parametrize(
    ("name", "value"), [("TACO_FFI_THREADS", "0"), ("TACO_FFI_THREADS", "two"), ("TACO_FFI_SPIN_US", "-1")]
)
def test_ffi_bad_env_knob_is_named(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' must be an integer"):
        ffi_codec.encode_groups(jnp.zeros((8, 32)), CodecConfig(group_size=32), last_count=32)


@needs_ffi
def test_ffi_group_result_does_not_depend_on_the_thread():
    """Chunks of a call run on the calling thread or on the library's helper threads; each group's
    result must be the same either way, with subnormal intermediates (helpers take the caller's
    FTZ/DAZ and rounding state). 4096 copies of one group = 8 chunks of 64 KiB."""
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(128) * np.float32(2e-38)).astype(np.float32)  # mostly subnormal
    row[:4] = [1e-30, -3e-31, 2e-38, -1e-45]
    x = jnp.asarray(np.tile(row, (4096, 1)))
    cfg = CodecConfig(group_size=128)
    codes, s, a = (np.asarray(t) for t in ffi_codec.encode_groups(x, cfg, last_count=128))
    one = [np.asarray(t) for t in ffi_codec.encode_groups(x[:1], cfg, last_count=128)]
    np.testing.assert_array_equal(codes.view(np.uint8), np.tile(one[0].view(np.uint8), (4096, 1)))
    np.testing.assert_array_equal(s, np.full(4096, one[1][0]))
    np.testing.assert_array_equal(a, np.full(4096, one[2][0]))
    # decode to subnormal outputs: smallest E4M3 code x tiny scale
    c = jnp.asarray(np.full((4096, 128), 1, np.uint8).view(CODE_DTYPES["e4m3"]))
    s_, a_ = jnp.full((4096,), 1e-30, jnp.float32), jnp.full((4096,), 1e2, jnp.float32)
    y = np.asarray(ffi_codec.decode_groups(c, s_, a_))
    y1 = np.asarray(ffi_codec.decode_groups(c[:1], s_[:1], a_[:1]))
    np.testing.assert_array_equal(y.view(np.uint32), np.tile(y1.view(np.uint32), (4096, 1)))


@needs_ffi
def test_ffi_last_count_applies_to_each_messages_last_group():
    cfg = CodecConfig(group_size=32)
    x, _ = make_groups(32, n_groups=5, batch=3, seed=2, last_count=32)  # groups 4, 9, 14 are last
    x[1, 4] = np.random.default_rng(3).standard_normal(32).astype(np.float32)  # a full "last" group
    for lc in (1, 7, 32):
        _, _, a = ffi_codec.encode_groups(jnp.asarray(x), cfg, last_count=lc)
        _, _, a_r = reference.encode_groups(jnp.asarray(x), cfg, last_count=lc)
        np.testing.assert_allclose(np.asarray(a), np.asarray(a_r), rtol=2.0**-18)


@needs_ffi
def test_ffi_under_vmap_matches_unbatched():
    cfg = CodecConfig(group_size=64, fmt="e5m2")
    x, lc = make_groups(64, n_groups=6, batch=3)
    batched = jax.vmap(lambda t: ffi_codec.encode_groups(t, cfg, last_count=lc))(jnp.asarray(x))
    single = ffi_codec.encode_groups(jnp.asarray(x), cfg, last_count=lc)
    for u, v in zip(batched, single, strict=True):
        np.testing.assert_array_equal(np.asarray(u).astype(np.float32), np.asarray(v).astype(np.float32))
    dec_b = jax.vmap(ffi_codec.decode_groups)(*batched)
    np.testing.assert_array_equal(np.asarray(dec_b), np.asarray(ffi_codec.decode_groups(*single)))


@needs_ffi
@pytest.mark.parametrize("layout", ["dual", "folded"])
def test_codec_encode_decode_with_ffi_backend_conform(layout):
    x = jnp.asarray(np.random.default_rng(4).standard_normal((37, 100)).astype(np.float32))  # partial last group
    cfg_r, cfg_f = CodecConfig(scale_layout=layout), CodecConfig(scale_layout=layout, backend="ffi")
    got, want = encode(x, cfg_f), encode(x, cfg_r)
    ones = jnp.ones_like(got.scale)
    prescale = (got.prescale, want.prescale) if layout == "dual" else (ones, ones)
    assert_conforms((got.codes, got.scale, prescale[0]), (want.codes, want.scale, prescale[1]), 128)
    assert_decode_conforms(decode(got, cfg_f), decode(got, cfg_r), 128)


@pytest.mark.parametrize(("g", "fmt"), [(32, "e4m3"), (128, "e5m2"), (512, "e4m3")])
def test_pallas_conforms_to_reference(g, fmt):
    check_backend("pallas", g, fmt, n_groups=20, batch=1 if g == 512 else 2)


def test_pallas_block_smaller_than_groups_and_padding():
    from taco_jax.kernels import pallas_codec  # noqa: PLC0415

    cfg = CodecConfig(group_size=32)
    x, lc = make_groups(32, n_groups=37, batch=1, seed=5)  # 37 groups: 3 programs of 16, padded
    got = pallas_codec.encode_groups(jnp.asarray(x), cfg, last_count=lc, block=16)
    assert_conforms(got, reference.encode_groups(jnp.asarray(x), cfg, last_count=lc), 32)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pallas_reads_and_writes_native_dtypes_and_decode_sum_conforms(dtype):
    """bfloat16 / float16 messages read as they are: encode conforms to `reference` on the same
    values in float32; decode written in the message dtype is within one ulp of the reference's
    rounded value; decode-sum of 3 ranks (float32 and message dtype out) conforms to the rank-order
    float32 sum of the reference's decodes."""
    from taco_jax.kernels import pallas_codec  # noqa: PLC0415

    g, cfg = 64, CodecConfig(group_size=64)
    xs = [make_groups(g, n_groups=20, batch=1, seed=r)[0].astype(dtype) for r in range(3)]
    lc = g // 3
    encs = [pallas_codec.encode_groups(jnp.asarray(x), cfg, last_count=lc) for x in xs]
    for x, e in zip(xs, encs):
        assert_conforms(e, reference.encode_groups(jnp.asarray(x.astype(np.float32)), cfg, last_count=lc), g)
    codes, s, a = (jnp.stack(t) for t in zip(*encs))
    want = [np.asarray(reference.decode_groups(codes[r], s[r], a[r])) for r in range(3)]
    got = pallas_codec.decode_groups(codes[0], s[0], a[0], dtype=dtype)
    assert got.dtype == dtype
    assert_decode_conforms(got, want[0], g, dtype=dtype)
    ref_max = sum(np.max(np.abs(w), axis=-1, keepdims=True) for w in want)
    for out in ("float32", dtype):
        got = pallas_codec.decode_sum_groups(codes, s, a, dtype=out)
        assert got.dtype == out and got.shape == codes.shape[1:]
        assert_decode_conforms(got, want[0] + want[1] + want[2], g, dtype=out, ref_max=ref_max)


# --------------------------------------------------------------------------------------
# Inside shard_map(check_vma=True) on the 8-device CPU mesh
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["reference", "pallas", pytest.param("ffi", marks=needs_ffi)],
)
def test_backend_inside_shard_map_matches_reference(name):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax import")
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("x",))
    g = 32
    cfg = CodecConfig(group_size=g)
    x, lc = make_groups(g, n_groups=3, batch=8, seed=6)
    enc, dec = codec_backends.get_backend(name)

    def body(xb):  # [1, n_groups, G] per device
        codes, s, a = enc(xb, cfg, last_count=lc)
        xr = dec(codes, s, a)
        for t in (codes, s, a, xr):  # outputs vary over the mesh axis like the input
            assert vma_of(t) == vma_of(xb) == {"x"}, (name, jax.typeof(t))
        return codes, s, a, xr

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 4, check_vma=True))
    codes, s, a, xr = f(jnp.asarray(x))
    assert_conforms((codes, s, a), reference.encode_groups(jnp.asarray(x), cfg, last_count=lc), g)
    assert_decode_conforms(xr, reference.decode_groups(codes, s, a), g)


# --------------------------------------------------------------------------------------
# GPU (run on the device machine: pytest -m gpu)
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["pallas", "triton", "ffi"])
@pytest.mark.parametrize("g", [32, 128, 512])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_backend_conforms_to_reference(name, g, fmt):
    avail = kernels.available_backends()
    if name not in avail:
        pytest.skip(f"{name} not available on this GPU machine (available: {avail})")
    check_backend(name, g, fmt, n_groups=64, batch=2)


@pytest.mark.gpu
@needs_gpu
@needs_ffi
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_ffi_fp8_casts_match_ml_dtypes(fmt):
    codes = np.arange(256, dtype=np.uint8).view(CODE_DTYPES[fmt])
    got = np.asarray(ffi_codec.fp8_cast(jnp.asarray(codes), jnp.float32))
    want = codes.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    x = _float_sweep()
    got8 = np.asarray(ffi_codec.fp8_cast(jnp.asarray(x), CODE_DTYPES[fmt])).view(np.uint8)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got8, x.astype(CODE_DTYPES[fmt]).view(np.uint8))
