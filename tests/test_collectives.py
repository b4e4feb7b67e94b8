"""Compressed collectives against their exact `lax` counterparts on the 8-device mesh (tensor axis = 4).

Error bound used throughout (derived in test_codec.test_roundtrip_error_bound): one E4M3
quantization changes a group by at most eps = 2^-4 (+ a subnormal term ≤ 3e-5) of its norm,
so for a sum S = Σ_r x_r over P ranks
  one-shot:  ||out - S|| <= eps · Σ_r ||x_r||
  two-shot:  ||out - S|| <= eps · Σ_r ||x_r|| + eps · (||S|| + eps · Σ_r ||x_r||)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import collectives as C
from taco_jax.codec import NONE, TACO, CodecConfig, resolve_codec, wire_for
from taco_jax.codec import wire as generic_wire
from taco_jax.codec.backends import default_platform
from taco_jax.kernels import ffi_codec

pytestmark = pytest.mark.fast

EPS = 2.0**-4 + 3e-5


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 1, shape[-1:])))


def _smap(mesh, fn, in_spec, out_spec):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec))


def _per_rank(x):  # x sharded over 8 devices along axis 0 -> [data, tensor, block...]
    return x.reshape(2, 4, x.shape[0] // 8, *x.shape[1:]).squeeze(2) if x.shape[0] == 8 else \
        x.reshape(2, 4, x.shape[0] // 8, *x.shape[1:])


@pytest.mark.parametrize("shape", [(8, 64, 256), (8, 6, 100)])  # second: flattened + padded chunks
def test_psum_none_is_lax_psum_bit_for_bit(mesh, shape):
    x = _x(shape)
    ours = _smap(mesh, lambda v: C.psum(v, "tensor", codec=NONE), P(("data", "tensor")), P("data"))(x)
    ref = _smap(mesh, lambda v: jax.lax.psum(v, "tensor"), P(("data", "tensor")), P("data"))(x)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
@pytest.mark.parametrize("shape", [(8, 64, 256), (8, 6, 100), (8, 3)])
def test_psum_taco_within_bound(mesh, algorithm, shape):
    x = _x(shape, seed=1)
    fn = functools.partial(C.psum, axis_name="tensor", codec=TACO, algorithm=algorithm)
    out = np.asarray(_smap(mesh, lambda v: fn(v), P(("data", "tensor")), P("data"))(x))
    parts = np.asarray(_per_rank(x))  # [data, tensor, ...]
    for d in range(2):
        s = parts[d].sum(0)
        got = out[d * (shape[0] // 8) : (d + 1) * (shape[0] // 8)].reshape(s.shape) if shape[0] > 8 else out[d]
        sum_norms = sum(np.linalg.norm(p) for p in parts[d])
        bound = EPS * sum_norms + (EPS * (np.linalg.norm(s) + EPS * sum_norms) if algorithm == "two_shot" else 0)
        err = np.linalg.norm(got - s)
        assert err <= bound, (err, bound)
        if algorithm == "one_shot" or np.prod(shape[1:]) > 4:  # (8, 3) two-shot: 1-element chunks, exact in FP8
            assert err > 0  # it really was compressed


def test_psum_result_identical_on_every_rank(mesh):
    x = _x((8, 32, 128), seed=2)
    out = _smap(mesh, lambda v: C.psum(v, "tensor", codec=TACO)[None], P(("data", "tensor")), P(("data", "tensor")))(x)
    out = np.asarray(out).reshape(2, 4, -1)
    for d in range(2):
        for r in range(1, 4):
            np.testing.assert_array_equal(out[d, r], out[d, 0])


@pytest.mark.parametrize("codec", [NONE, TACO, CodecConfig(fmt="e5m2", group_size=32)])
@pytest.mark.parametrize("axis,tiled", [(0, True), (1, True), (0, False), (1, False), (2, True)])
def test_all_gather(mesh, codec, axis, tiled):
    x = _x((8, 16, 64), seed=3)
    fn = lambda v: C.all_gather(v, "tensor", codec=codec, axis=axis, tiled=tiled)  # noqa: E731
    ref = lambda v: jax.lax.all_gather(v, "tensor", axis=axis, tiled=tiled)  # noqa: E731
    got = _smap(mesh, fn, P(("data", "tensor")), P(("data", "tensor")))(x)
    want = _smap(mesh, ref, P(("data", "tensor")), P(("data", "tensor")))(x)
    assert got.shape == want.shape
    if codec.kind == "none":
        np.testing.assert_array_equal(got, want)
    else:
        eps = 2.0**-4 if codec.fmt == "e4m3" else 2.0**-3
        assert np.linalg.norm(got - want) <= (eps + 1e-4) * np.linalg.norm(want)


@pytest.mark.parametrize("codec", [NONE, TACO])
@pytest.mark.parametrize("dim", [0, 1, 2])  # dim 1: fused path reads x's blocks in place; 2: transposing fallback
def test_psum_scatter(mesh, codec, dim):
    x = _x((32, 16, 128), seed=4)
    fn = lambda v: C.psum_scatter(v, "tensor", codec=codec, scatter_dimension=dim)  # noqa: E731
    ref = lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=dim, tiled=True)  # noqa: E731
    got = _smap(mesh, fn, P(("data", "tensor")), P(("data", "tensor")))(x)
    want = _smap(mesh, ref, P(("data", "tensor")), P(("data", "tensor")))(x)
    if codec.kind == "none":
        np.testing.assert_array_equal(got, want)
    else:
        parts = np.asarray(_per_rank(x))
        sum_norms = sum(np.linalg.norm(p) for d in range(2) for p in parts[d])
        assert 0 < np.linalg.norm(got - want) <= EPS * sum_norms


@pytest.mark.parametrize("codec", [NONE, TACO])
def test_ppermute(mesh, codec):
    x = _x((8, 8, 128), seed=5)
    perm = [(i, (i + 1) % 4) for i in range(4)]
    spec = P(("data", "tensor"))
    got = _smap(mesh, lambda v: C.ppermute(v, "tensor", perm, codec=codec), spec, spec)(x)
    want = _smap(mesh, lambda v: jax.lax.ppermute(v, "tensor", perm), spec, spec)(x)
    tol = 0 if codec.kind == "none" else EPS
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_nan_in_psum_stays_nan(mesh):
    x = _x((8, 16, 128), seed=6).at[1, 0, 0].set(jnp.nan)
    out = _smap(mesh, lambda v: C.psum(v, "tensor", codec=TACO), P(("data", "tensor")), P("data"))(x)
    assert np.isnan(np.asarray(out)[0, 0, 0])  # data group 0 holds rank 1


# ---------------- a sum that overflows the message dtype: ±Inf in that element only ----------------

FFI_REASON = ffi_codec.unavailable_reason(default_platform())
needs_ffi = pytest.mark.skipif(FFI_REASON is not None, reason=f"FFI codec library not available: {FFI_REASON}")
#: The codecs an overflow is checked with in a collective (pallas: at the wire level below; its CPU
#: interpreter is refused in multi-device programs).
OVERFLOW_CODECS = [
    pytest.param(CodecConfig(backend="reference", wire="generic"), id="reference"),
    pytest.param(CodecConfig(backend="ffi", wire="ffi"), id="ffi", marks=needs_ffi),
    pytest.param(CodecConfig(backend="ffi", wire="generic", scale_layout="folded", fmt="e5m2"),
                 id="ffi-generic-folded-e5m2", marks=needs_ffi),
    pytest.param(CodecConfig(kind="fp8_group", fmt="e5m2", group_size=64), id="fp8_group-e5m2"),
]


def _overflowing(p: int, m: int, dtype, seed: int = 0) -> np.ndarray:
    """[p, m] messages of N(0, 100) whose sum over the p ranks overflows float16 in two elements of
    two groups (element 7: 20000 on every rank, +Inf; element 300: -20000, -Inf) and comes close
    to its largest finite value (65504) in the first of them (element 8: 15500 each, 62000), in `dtype`."""
    x = np.random.default_rng(seed).normal(0, 100, (p, m)).astype(np.float32)
    x[:, 7], x[:, 8], x[:, 300] = 20000.0, 15500.0, -20000.0
    return x.astype(dtype)


def _assert_overflow_only_where_exact(got, want, ranks, codec: CodecConfig):
    """`got` (a compressed sum) against `want` (the exact one, with ±Inf): the same ±Inf, no NaN,
    and each group of `codec` within the two-shot bound of the module docstring (eps 2^-3 for E5M2)."""
    got, want, ranks = (np.asarray(t, np.float32) for t in (got, want, ranks))
    eps, cut = (EPS if codec.fmt == "e4m3" else 2.0**-3 + 3e-5), codec.group_size
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert not np.isnan(got).any() and np.isinf(want).sum() == 2 * want.shape[0]
    for row in range(got.shape[0]):
        for g0 in range(0, got.shape[1], cut):
            fin = np.isfinite(want[row, g0:g0 + cut])
            w, d = want[row, g0:g0 + cut][fin], got[row, g0:g0 + cut][fin]
            sum_norms = sum(np.linalg.norm(r[row, g0:g0 + cut]) for r in ranks)  # each rank's group is finite
            bound = eps * sum_norms + eps * (np.linalg.norm(w) + eps * sum_norms) + 2.0**-10 * np.abs(w).max()
            assert np.linalg.norm(d - w) <= bound, (row, g0, np.linalg.norm(d - w), bound)


@pytest.mark.parametrize("codec", OVERFLOW_CODECS)
def test_two_shot_overflow_is_inf_in_its_element_only(mesh, codec):
    """Issue 52: float16 messages whose sum overflows in one element of a group. The exact all-reduce
    gives ±Inf there; the two-shot one rounded its FP32 partial sum to float16 and encoded the Inf
    again, which gave the whole group a NaN scale (128 NaN). Now: the same ±Inf, no NaN, the other
    127 elements of the group finite and within the two-shot bound (the 62000 one too)."""
    x = jnp.asarray(np.concatenate([_overflowing(4, 512, np.float16, seed=d) for d in range(2)]))  # [8, 512]
    spec = (P(("data", "tensor")), P("data"))
    want = _smap(mesh, lambda v: jax.lax.psum(v, "tensor"), *spec)(x)
    got = _smap(mesh, lambda v: C.psum(v, "tensor", codec=codec), *spec)(x)
    assert got.dtype == jnp.float16
    ranks = np.asarray(x, np.float32).reshape(2, 4, 512).transpose(1, 0, 2)
    _assert_overflow_only_where_exact(got, want, ranks, codec)
    assert np.all(np.asarray(got, np.float32)[:, 8] > 50000)  # 62000: near the largest float16, finite


@pytest.mark.parametrize("codec", OVERFLOW_CODECS[:2])
def test_other_sums_of_an_overflow_give_inf_too(mesh, codec):
    """The one-shot all-reduce and the reduce-scatter (one FP32 sum, rounded once) give the exact
    ±Inf; the Hadamard-domain two-shot never rounds the partial sum to float16, and its final decode
    clips to float16's range as every decode does: ±65504 there, and no NaN."""
    x = jnp.asarray(np.concatenate([_overflowing(4, 512, np.float16, seed=d) for d in range(2)]))
    spec = (P(("data", "tensor")), P("data"))
    want = _smap(mesh, lambda v: jax.lax.psum(v, "tensor"), *spec)(x)
    ranks = np.asarray(x, np.float32).reshape(2, 4, 512).transpose(1, 0, 2)
    got = _smap(mesh, lambda v: C.psum(v, "tensor", codec=codec, algorithm="one_shot"), *spec)(x)
    _assert_overflow_only_where_exact(got, want, ranks, codec)
    rs = _smap(mesh, lambda v: C.psum_scatter(v, "tensor", codec=codec, scatter_dimension=1),
               P(("data", "tensor")), P(("data", "tensor")))(x)
    want_rs = _smap(mesh, lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=1, tiled=True),
                    P(("data", "tensor")), P(("data", "tensor")))(x)
    np.testing.assert_array_equal(np.isinf(rs), np.isinf(want_rs))
    assert not np.isnan(np.asarray(rs, np.float32)).any()
    had = np.asarray(_smap(mesh, lambda v: C.psum(v, "tensor", codec=codec, reduce_domain="hadamard"), *spec)(x),
                     np.float32)
    assert not np.isnan(had).any() and np.all(had[:, [7, 300]] == [65504.0, -65504.0])


WIRE_CODECS = [
    pytest.param(CodecConfig(backend="reference", wire="generic"), id="reference"),
    pytest.param(CodecConfig(backend="ffi", wire="ffi"), id="ffi", marks=needs_ffi),
    pytest.param(CodecConfig(backend="ffi", wire="generic"), id="ffi-generic", marks=needs_ffi),
    pytest.param(CodecConfig(backend="pallas", wire="generic"), id="pallas",
                 marks=pytest.mark.filterwarnings("ignore:codec backend 'pallas' on CPU")),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("codec", WIRE_CODECS)
def test_two_shot_steps_keep_an_overflow_to_its_element_on_every_backend(codec, dtype):
    """The two-shot all-reduce's steps on 4 ranks' rows, one process (as `compressed._two_shot` runs
    them between its all-to-all and all-gather): the middle step (`reduce_rows`) on a partial sum
    that overflows the message dtype, then the final decode; and the reduce-scatter's decode-sum.
    Both give ±Inf in the overflowing elements only, as the FP32 sum of the ranks' decoded rows
    rounded to the dtype does (before: the middle step's group got a NaN scale, 128 NaN; pallas
    clipped its decode-sum to 65504). bfloat16 overflows only beyond float32's range, which no
    encoder's rows reach (taco's scales are clipped): its rows are the float16 case's, the scales of
    the two groups holding elements 7, 8 and 300 changed (s * 2^76, a * 2^-36) so that these groups
    decode 2^112 times larger (element 7: 1.0e38 on each rank)."""
    cfg = resolve_codec(codec)
    p, m = 4, 512
    x = jnp.asarray(_overflowing(p, m, dtype))
    w = wire_for(cfg, x)
    rows = w.encode_rows(x, cfg, batch_dims=1, per_rank=True)  # [P, row_bytes]: rank r's message
    if dtype == "bfloat16":
        enc = generic_wire.unpack_rows(rows, cfg, (m,), dtype)
        big = np.isin(np.arange(enc.scale.shape[-1]), [7 // cfg.group_size, 300 // cfg.group_size])
        enc = dataclasses.replace(enc, scale=enc.scale * np.where(big, 2.0**76, 1.0).astype(np.float32),
                                  prescale=enc.prescale * np.where(big, 2.0**-36, 1.0).astype(np.float32))
        rows = generic_wire.pack_rows(enc, 1)
    ranks = [rows[r] for r in range(p)]
    with np.errstate(over="ignore"):  # the FP32 sum of the ranks' decoded rows, rank order, rounded to dtype
        want = np.asarray(sum(np.asarray(w.decode_rows(rows, cfg, (m,), jnp.float32))).astype(dtype), np.float64)
    assert np.isposinf(want[7]) and np.isneginf(want[300]) and np.isinf(want).sum() == 2
    rs = np.asarray(w.decode_sum_rows(ranks, cfg, (m,), dtype), np.float64)  # the reduce-scatter's sum
    np.testing.assert_array_equal(rs[np.isinf(want)], want[np.isinf(want)])
    assert np.isfinite(rs[np.isfinite(want)]).all()
    mine = w.reduce_rows(ranks, cfg, (m,), dtype, "signal")
    assert not np.isnan(generic_wire.unpack_rows(mine, cfg, (m,), dtype).scale).any()  # no NaN group
    got = np.asarray(w.decode_rows(mine[None], cfg, (m,), dtype, overflow=True)[0], np.float64)
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert not np.isnan(got).any()
    for g0 in range(0, m, cfg.group_size):  # the second quantization's error only, group by group
        fin = np.isfinite(want[g0:g0 + cfg.group_size])
        wg, dg = want[g0:g0 + cfg.group_size][fin], got[g0:g0 + cfg.group_size][fin]
        assert np.linalg.norm(dg - wg) <= EPS * np.linalg.norm(wg) + 2.0**-10 * np.abs(wg).max(), g0


def test_compressed_psum_scatter_rejects_indivisible(mesh):
    x = _x((8, 6, 128))
    with pytest.raises(ValueError, match="not divisible by axis size 4"):
        _smap(mesh, lambda v: C.psum_scatter(v, "tensor", codec=TACO, scatter_dimension=1),
              P(("data", "tensor")), P(("data", "tensor")))(x)


def test_unknown_algorithm_raises():
    with pytest.raises(ValueError, match="all_reduce_algorithm='ring'"):
        C.CommPolicy(all_reduce_algorithm="ring")


# ---------------- Megatron f/g and the sequence-parallel pair: gradients ----------------


def _mlp_loss(mesh, policy, sp=False):
    """Column -> tanh -> Row MLP over the tensor axis; returns a scalar loss of (x, w1, w2)."""

    def local(x, w1, w2):
        if sp:
            h = C.gather_from_sp(x, "tensor", policy, 1)
        else:
            h = C.copy_to_tp(x, "tensor", policy)
        y = jnp.tanh(h @ w1) @ w2
        y = C.scatter_to_sp(y, "tensor", policy, 1) if sp else C.reduce_from_tp(y, "tensor", policy)
        return jax.lax.pmean(jnp.sum(jnp.sin(y)), ("data", "tensor") if sp else "data")

    xspec = P("data", "tensor") if sp else P("data")
    return jax.shard_map(local, mesh=mesh, in_specs=(xspec, P(None, "tensor"), P("tensor", None)), out_specs=P())


def _mlp_ref(x, w1, w2):
    return sum(jnp.sum(jnp.sin(jnp.tanh(xx @ w1) @ w2)) for xx in jnp.split(x, 2)) / 2


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_grads_exact_with_none(mesh, sp):
    x, w1, w2 = _x((4, 32, 64), 7), _x((64, 128), 8) / 8, _x((128, 64), 9) / 11
    scale = 4 if sp else 1  # pmean over the tensor axis too when the loss is sequence-sharded
    got = jax.jit(jax.grad(_mlp_loss(mesh, C.CommPolicy.none(), sp), argnums=(0, 1, 2)))(x, w1, w2)
    want = jax.grad(_mlp_ref, argnums=(0, 1, 2))(x, w1, w2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g) * scale, w, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("sp", [False, True])
def test_megatron_grads_compressed_close(mesh, sp):
    """Forward and backward both quantized: gradients within 4·eps relative (two two-shot passes).

    Inputs keep tanh out of saturation (pre-activations O(1)): with sequence parallelism the
    forward all-gather quantizes x itself, and a saturated tanh' = 1 - tanh² would amplify that
    relative error without bound — a property of the test function, not of the operators.
    """
    x, w1, w2 = _x((4, 32, 64), 7) / 4, _x((64, 128), 8) / 32, _x((128, 64), 9) / 11
    exact = jax.jit(jax.grad(_mlp_loss(mesh, C.CommPolicy.none(), sp), argnums=(0, 1, 2)))(x, w1, w2)
    taco = jax.jit(jax.grad(_mlp_loss(mesh, C.CommPolicy.taco(), sp), argnums=(0, 1, 2)))(x, w1, w2)
    for g, w in zip(taco, exact, strict=True):
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert 0 < rel < 4 * EPS, rel


def test_megatron_backward_is_compressed_in_hlo(mesh):
    """The backward all-reduce of "f" moves u8 (FP8 codes), not an FP32 all-reduce."""
    x, w1, w2 = _x((4, 32, 64), 7), _x((64, 128), 8), _x((128, 64), 9)
    pol = C.CommPolicy(ar_bwd=TACO)  # only the backward site compressed
    hlo = jax.jit(jax.grad(_mlp_loss(mesh, pol), argnums=(0,))).lower(x, w1, w2).compile().as_text()
    from taco_jax.collectives.hlo import collective_bytes

    ops = {(r["axis"], r["op"], r["dtype"]) for r in collective_bytes(hlo, mesh)["detail"]}
    assert ("tensor", "all-to-all", "u8") in ops and ("tensor", "all-gather", "u8") in ops
    assert ("tensor", "all-reduce", "f32") in ops  # the forward "g" stayed exact


@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
def test_psum_over_an_axis_of_size_one_is_x_and_invariant(algorithm):
    """P = 1 (e.g. `--mesh data=4,tensor=1`): the compressed psum is x itself, typed invariant over the
    axis like `lax.psum`, so a following ColumnParallel input `pcast(..., to="varying")` is accepted
    (no "Unsupported pcast from=varying, to='varying'")."""
    mesh = jax.make_mesh((8, 1), ("data", "tensor"), devices=jax.devices())
    x = jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256) / 100

    def body(v):
        v = jax.lax.pcast(v, "tensor", to="varying")
        y = C.psum(v, "tensor", codec=TACO, algorithm=algorithm)
        jax.lax.pcast(y, "tensor", to="varying")  # traced: raises if y were typed varying already
        return y  # out_specs P("data"): y must be invariant over "tensor"

    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(xs)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
