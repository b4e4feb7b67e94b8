"""Derivatives of the compressed collectives: the transpose of the exact collective, with the backward
message through `bwd_codec`, and zero-size messages (no communication).

Error yardstick: `rt(kind)`, the relative error of one encode/decode round trip of the test's own
data (`codec.roundtrip`). A collective quantizes each message once (two-shot all-reduce: twice),
so its relative error is a small multiple of that; "none" is bit-exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax import collectives as C
from taco_jax.codec import NONE, TACO, CodecConfig, codec_kinds, roundtrip
from taco_jax.collectives.dp import sync_gradients
from taco_jax.collectives.hlo import collective_bytes
from taco_jax.collectives.pipeline_send import send

pytestmark = pytest.mark.fast

KINDS = [CodecConfig(kind=k) for k in codec_kinds()]
XSPEC = P(("data", "tensor"))  # rank (d, t) holds rows [4d + t] of the global array's blocks


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def _rt(codec, x):
    """Relative error of one round trip of x through `codec` (0 for none)."""
    return float(_rel(roundtrip(x, codec), x))


# ---------------- the input: psum's gradient is c on every rank ----------------


@pytest.fixture(scope="module")
def tmesh():
    """One 8-device `tensor` axis (Auto axis types)."""
    return Mesh(np.asarray(jax.devices()), ("tensor",))


@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
@pytest.mark.parametrize("codec", [NONE, TACO, CodecConfig(kind="int8"), CodecConfig(kind="fp8_group")],
                         ids=lambda c: c.kind)
def test_psum_gradient_is_c_on_every_rank(tmesh, algorithm, codec):
    x = jax.random.normal(jax.random.key(0), (8, 16, 128))
    c = jax.random.normal(jax.random.key(1), (16, 128))

    def loss(x):
        local = lambda xl: jnp.sum(c * C.psum(xl[0], "tensor", codec=codec, algorithm=algorithm))  # noqa: E731
        return jax.shard_map(local, mesh=tmesh, in_specs=P("tensor"), out_specs=P(), check_vma=True)(x)

    g = jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(g, jnp.broadcast_to(c, x.shape))  # psum's transpose: no message, exact


# ---------------- each collective against lax: forward and vjp ----------------

# local x [4, 8, 64] per rank of the data=2 × tensor=4 mesh; (ours(x, codec, bwd), lax(x), out spec)
_RING = [(i, (i + 1) % 4) for i in range(4)]
_CHAIN = [(0, 1), (1, 2), (2, 3)]  # rank 0 receives zeros
CASES = {
    "psum_two_shot": (lambda v, c, b: C.psum(v, "tensor", codec=c, algorithm="two_shot"),
                      lambda v: jax.lax.psum(v, "tensor"), P("data"), 2),
    "psum_one_shot": (lambda v, c, b: C.psum(v, "tensor", codec=c, algorithm="one_shot"),
                      lambda v: jax.lax.psum(v, "tensor"), P("data"), 1),
    "all_gather_tiled_1": (lambda v, c, b: C.all_gather(v, "tensor", codec=c, bwd_codec=b, axis=1, tiled=True),
                           lambda v: jax.lax.all_gather(v, "tensor", axis=1, tiled=True), XSPEC, 1),
    "all_gather_stacked_0": (lambda v, c, b: C.all_gather(v, "tensor", codec=c, bwd_codec=b, axis=0),
                             lambda v: jax.lax.all_gather(v, "tensor", axis=0), XSPEC, 1),
    "psum_scatter_tiled_1": (
        lambda v, c, b: C.psum_scatter(v, "tensor", codec=c, bwd_codec=b, scatter_dimension=1),
        lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=1, tiled=True), XSPEC, 1),
    "psum_scatter_untiled_0": (
        lambda v, c, b: C.psum_scatter(v, "tensor", codec=c, bwd_codec=b, scatter_dimension=0, tiled=False),
        lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=0, tiled=False), XSPEC, 1),
    "ppermute_ring": (lambda v, c, b: C.ppermute(v, "tensor", _RING, codec=c, bwd_codec=b),
                      lambda v: jax.lax.ppermute(v, "tensor", _RING), XSPEC, 1),
    "ppermute_chain": (lambda v, c, b: C.ppermute(v, "tensor", _CHAIN, codec=c, bwd_codec=b),
                       lambda v: jax.lax.ppermute(v, "tensor", _CHAIN), XSPEC, 1),
}


def _vjp(mesh, fn, out_spec):
    """Jitted (x, w) -> (F(x), w · dF/dx) of the global function F = shard_map(fn)."""

    def run(x, w):
        y, vjp = jax.vjp(jax.shard_map(fn, mesh=mesh, in_specs=XSPEC, out_specs=out_spec), x)
        return y, vjp(w)[0]

    return jax.jit(run)


def _out_shape(mesh, ref, out_spec):
    x = jax.ShapeDtypeStruct((32, 8, 64), jnp.float32)
    return jax.eval_shape(jax.shard_map(ref, mesh=mesh, in_specs=XSPEC, out_specs=out_spec), x).shape


def _inputs(out_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 8, 64)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(out_shape).astype(np.float32))
    return x, w


_EXACT = {}


def _exact(mesh, case):
    """(x, w, lax value, lax vjp) of `case`, computed once per case."""
    if case not in _EXACT:
        _, ref, out_spec, _ = CASES[case]
        x, w = _inputs(_out_shape(mesh, ref, out_spec))
        _EXACT[case] = (x, w, *_vjp(mesh, ref, out_spec)(x, w))
    return _EXACT[case]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("codec", KINDS, ids=lambda c: c.kind)
@pytest.mark.cover(4)
def test_vjp_matches_lax_collective(mesh, case, codec):
    ours, _, out_spec, quantizations = CASES[case]
    x, w, y_want, g_want = _exact(mesh, case)
    y, g = _vjp(mesh, lambda v: ours(v, codec, None), out_spec)(x, w)
    assert (y.shape, y.dtype, g.shape, g.dtype) == (y_want.shape, y_want.dtype, g_want.shape, g_want.dtype)
    if codec.kind == "none":
        np.testing.assert_array_equal(y, y_want)
        np.testing.assert_array_equal(g, g_want)
        return
    fwd_err, bwd_err = _rel(y, y_want), _rel(g, g_want)
    tol_f = 2 * quantizations * _rt(codec, x) + 1e-6
    assert 0 < fwd_err <= tol_f, (fwd_err, tol_f)
    if case in ("psum_two_shot", "psum_one_shot"):
        np.testing.assert_array_equal(g, g_want)  # the transpose of an all-reduce moves nothing
    else:
        tol_b = 2 * _rt(codec, w) + 1e-6
        assert 0 < bwd_err <= tol_b, (bwd_err, tol_b)


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("psum_two_shot", "psum_one_shot")])
def test_bwd_codec_is_chosen_by_the_caller(mesh, case):
    """Compressed forward + exact backward gives lax's gradient bit for bit; exact forward +
    compressed backward gives lax's value bit for bit and a quantized gradient."""
    ours, _, out_spec, _ = CASES[case]
    x, w, y_want, g_want = _exact(mesh, case)
    y, g = _vjp(mesh, lambda v: ours(v, TACO, NONE), out_spec)(x, w)
    np.testing.assert_array_equal(g, g_want)
    assert _rel(y, y_want) > 0
    y, g = _vjp(mesh, lambda v: ours(v, NONE, TACO), out_spec)(x, w)
    np.testing.assert_array_equal(y, y_want)
    assert 0 < _rel(g, g_want) <= 2 * _rt(TACO, w)


def test_second_order_through_all_gather(mesh):
    """The backward is itself a compressed collective, so grad-of-grad is defined (exact for none)."""

    def make(codec):
        def local(v):
            g = C.all_gather(v, "tensor", codec=codec, axis=1, tiled=True)
            return jax.lax.psum(jnp.sum(jnp.sin(g)), ("data", "tensor"))

        f = jax.shard_map(local, mesh=mesh, in_specs=XSPEC, out_specs=P())
        return jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2)))

    x, _ = _inputs((1,))
    x = x / 4
    exact = make(NONE)(x)
    ref = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(lambda v: 4 * jnp.sum(jnp.sin(v)))(x) ** 2)))(x)
    np.testing.assert_allclose(exact, ref, rtol=1e-5, atol=1e-6)
    assert 0 < _rel(make(TACO)(x), exact) < 8 * _rt(TACO, x)


def test_jvp_defined_for_none_and_refused_for_compressing_codecs(mesh):
    x, _ = _inputs((1,))
    for codec in (NONE, TACO):
        f = jax.jit(jax.shard_map(lambda v, c=codec: C.all_gather(v, "tensor", codec=c, axis=1, tiled=True),
                                  mesh=mesh, in_specs=XSPEC, out_specs=XSPEC))
        if codec.kind == "none":
            _, t = jax.jvp(f, (x,), (x,))
            np.testing.assert_array_equal(t, f(x))  # linear: the tangent is the collective of the tangent
        else:
            with pytest.raises(TypeError, match="custom_vjp"):
                jax.jvp(f, (x,), (x,))


# ---------------- the DP helper and the pipeline send ----------------


@pytest.mark.parametrize("codec", [NONE, TACO, CodecConfig(kind="int4", hadamard=True)], ids=lambda c: c.kind)
def test_sync_gradients_derivative_is_psum_transpose(mesh, codec):
    policy = C.CommPolicy(dp_grads=codec)
    x, _ = _inputs((1,))
    c = jnp.asarray(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32))

    def loss(x):
        def local(v):
            tree = {"a": v[0], "b": v[1:3]}
            out = sync_gradients(tree, "data", policy)
            return jax.lax.psum(jnp.sum(out["a"] * c) + jnp.sum(out["b"] * c), "tensor")

        return jax.shard_map(local, mesh=mesh, in_specs=P(("data", "tensor")), out_specs=P())(x)

    g = np.asarray(jax.jit(jax.grad(loss))(x)).reshape(8, 4, 8, 64)
    np.testing.assert_array_equal(g[:, 0], np.broadcast_to(c, (8, 8, 64)))
    np.testing.assert_array_equal(g[:, 1:3], np.broadcast_to(c, (8, 2, 8, 64)))
    np.testing.assert_array_equal(g[:, 3], 0)


def test_pipeline_send_bwd_codec(mesh):
    """send's backward goes back s+1 -> s through the codec the caller chose (here exact)."""
    x, w = _inputs((32, 8, 64))
    pol = C.CommPolicy(pp_send=TACO)
    y_want, g_want = _vjp(mesh, lambda v: jax.lax.ppermute(v, "tensor", _CHAIN), XSPEC)(x, w)
    y, g = _vjp(mesh, lambda v: send(v, "tensor", pol, 1, bwd_codec=NONE), XSPEC)(x, w)
    np.testing.assert_array_equal(g, g_want)
    assert 0 < _rel(y, y_want) <= 2 * _rt(TACO, x)


# ---------------- zero-size messages ----------------

EMPTY_CASES = {
    "psum_two_shot": (lambda v, c: C.psum(v, "tensor", codec=c), P("data")),
    "psum_one_shot": (lambda v, c: C.psum(v, "tensor", codec=c, algorithm="one_shot"), P("data")),
    "all_gather_tiled": (lambda v, c: C.all_gather(v, "tensor", codec=c, tiled=True), XSPEC),
    "all_gather_stacked": (lambda v, c: C.all_gather(v, "tensor", codec=c, axis=1), XSPEC),
    "psum_scatter": (lambda v, c: C.psum_scatter(v, "tensor", codec=c, scatter_dimension=0), XSPEC),
    "ppermute": (lambda v, c: C.ppermute(v, "tensor", _RING, codec=c), XSPEC),
}


@pytest.mark.parametrize("case", list(EMPTY_CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_empty_message_no_communication(mesh, case, dtype):
    fn, out_spec = EMPTY_CASES[case]
    x = jnp.zeros((0, 128), dtype)
    want = jax.eval_shape(jax.shard_map(lambda v: fn(v, NONE), mesh=mesh, in_specs=XSPEC, out_specs=out_spec), x)
    f = jax.jit(jax.shard_map(lambda v: fn(v, TACO), mesh=mesh, in_specs=XSPEC, out_specs=out_spec))
    out = f(x)
    assert (out.shape, out.dtype) == (want.shape, want.dtype)
    assert collective_bytes(f.lower(x).compile().as_text(), mesh)["detail"] == []
    g = jax.jit(jax.grad(lambda v: jnp.sum(jax.shard_map(lambda u: fn(u, TACO), mesh=mesh, in_specs=XSPEC,
                                                         out_specs=out_spec)(v).astype(jnp.float32))))(x)
    assert (g.shape, g.dtype) == (x.shape, x.dtype)
