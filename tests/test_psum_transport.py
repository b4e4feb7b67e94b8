"""Two-shot all-reduce options for real transports: the transform-domain reduction
(`reduce_domain="hadamard"`), K-chunk pipelining (`chunks`), and the fused FFI reduction kernel.

Simulated 8-device mesh (data=2 x tensor=4). Error bound of a two-shot sum (tests/test_collectives.py):
||out - S|| <= eps * sum_r ||x_r|| + eps * (||S|| + eps * sum_r ||x_r||), eps = 2^-4 (E4M3).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import collectives as C
from taco_jax import kernels
from taco_jax.codec import NONE, TACO, encode, reduce_groups
from taco_jax.codec.backends import default_platform
from taco_jax.collectives import compressed
from taco_jax.kernels import ffi_codec

pytestmark = pytest.mark.fast

EPS = 2.0**-4 + 3e-5
FFI_REASON = ffi_codec.unavailable_reason(default_platform())
needs_ffi = pytest.mark.skipif(FFI_REASON is not None, reason=f"FFI codec library not available: {FFI_REASON}")
SPEC = P(("data", "tensor"))


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 1, shape[-1:])))


def _psum(mesh, **kw):
    return jax.jit(jax.shard_map(lambda v: C.psum(v, "tensor", **kw), mesh=mesh, in_specs=SPEC, out_specs=P("data")))


def _check_two_shot_bound(x, out):
    parts = np.asarray(x).reshape(2, 4, *x.shape[1:])  # [data, tensor, ...] (one row per device)
    out = np.asarray(out)
    for d in range(2):
        s, got = parts[d].sum(0), out[d]
        sum_norms = sum(np.linalg.norm(p) for p in parts[d])
        err = np.linalg.norm(got - s)
        assert 0 < err <= EPS * sum_norms + EPS * (np.linalg.norm(s) + EPS * sum_norms), err


@pytest.mark.parametrize("backend,kw,shape", [
    ("reference", dict(reduce_domain="hadamard", chunks=3), (8, 16, 256)),
    ("reference", dict(reduce_domain="hadamard"), (8, 6, 100)),  # flattened + padded chunks
    pytest.param("ffi", dict(reduce_domain="hadamard"), (8, 6, 100), marks=needs_ffi),
    pytest.param("ffi", dict(reduce_domain="hadamard", chunks=3), (8, 64, 256), marks=needs_ffi),
    pytest.param("ffi", dict(reduce_domain="signal", chunks=3), (8, 64, 256), marks=needs_ffi),
    pytest.param("ffi", dict(reduce_domain="hadamard", chunks=4), (8, 6, 100), marks=needs_ffi),  # k clipped to 1
], ids=str)
def test_psum_options_within_two_shot_bound(mesh, backend, kw, shape):
    codec = kernels.resolve_codec(dataclasses.replace(TACO, backend=backend))
    x = _x(shape, seed=1)
    out = _psum(mesh, codec=codec, **kw)(x)
    _check_two_shot_bound(x, out)


def test_hadamard_domain_as_accurate_as_signal_domain(mesh):
    """Same quantizer up to float rounding: the two results agree far inside the codec's error."""
    x = _x((8, 16, 512), seed=2)
    want = np.asarray(x).reshape(2, 4, 16, 512).sum(1)
    sig = np.asarray(_psum(mesh, codec=TACO, reduce_domain="signal")(x))
    had = np.asarray(_psum(mesh, codec=TACO, reduce_domain="hadamard")(x))
    e_sig, e_had = np.linalg.norm(sig - want), np.linalg.norm(had - want)
    assert e_had <= 1.01 * e_sig
    assert np.linalg.norm(had - sig) <= 0.1 * e_sig


@pytest.mark.parametrize("kw", [dict(reduce_domain="hadamard", chunks=3), dict(chunks="auto")], ids=str)
def test_none_codec_still_lax_psum_bit_for_bit(mesh, kw):
    x = _x((8, 64, 256), seed=3)
    ours = _psum(mesh, codec=NONE, **kw)(x)
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tensor"), mesh=mesh, in_specs=SPEC, out_specs=P("data")))(x)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("kw", [dict(reduce_domain="hadamard"), dict(chunks=2, reduce_domain="hadamard"),
                                dict(chunks=2, reduce_domain="signal")], ids=str)
def test_gradient_is_lax_psums(mesh, kw):
    """d/dx of sum(w * psum(x)) is w on every rank (lax.psum's transpose), whatever the options."""
    x, w = _x((8, 16, 128), seed=4), _x((2, 16, 128), seed=5)

    def loss(fn):
        f = jax.shard_map(lambda v, u: jax.lax.psum(jnp.sum(u * fn(v)), "data"), mesh=mesh,
                          in_specs=(SPEC, P("data")), out_specs=P())
        return jax.jit(jax.grad(lambda v: f(v, w)))(x)

    ours = loss(lambda v: C.psum(v, "tensor", codec=TACO, **kw))
    ref = loss(lambda v: jax.lax.psum(v, "tensor"))
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("kw", [dict(reduce_domain="hadamard"), dict(reduce_domain="hadamard", chunks=2)], ids=str)
def test_nan_in_stays_nan(mesh, kw):
    x = _x((8, 16, 128), seed=6).at[1, 0, 0].set(jnp.nan)
    out = np.asarray(_psum(mesh, codec=TACO, **kw)(x))
    assert np.isnan(out[0, 0, 0]) and not np.isnan(out[1]).any()  # data group 0 holds rank 1


def test_bad_options_raise_before_tracing():
    x = jnp.zeros((4,))
    with pytest.raises(ValueError, match="reduce_domain='time'"):
        C.psum(x, "tensor", codec=TACO, reduce_domain="time")
    for bad in (0, True, 2.0, "many"):
        with pytest.raises(ValueError, match="chunks="):
            C.psum(x, "tensor", codec=TACO, chunks=bad)
    with pytest.raises(ValueError, match="reduce_domain='x'"):
        C.CommPolicy(reduce_domain="x")
    with pytest.raises(ValueError, match="chunks=0"):
        C.CommPolicy(chunks=0)


def test_policy_fields_round_trip():
    pol = C.CommPolicy.taco(reduce_domain="signal", chunks="auto")
    back = C.CommPolicy.from_dict(pol.to_dict())
    assert (back.reduce_domain, back.chunks) == ("signal", "auto")
    assert C.CommPolicy().reduce_domain == "signal"  # the default (README: why not "hadamard")


def test_auto_chunks():
    assert compressed.auto_chunks(1 << 30, "cpu") == 1  # gloo: extra collectives cost more than overlap
    assert compressed.auto_chunks(1 << 20, "cuda") == 1
    assert compressed.auto_chunks(16 << 20, "cuda") == 2
    assert compressed.auto_chunks(1 << 30, "cuda") == compressed.AUTO_MAX_CHUNKS


def test_wire_buffers_move_in_one_collective_per_hop(mesh):
    """Codes and scales are packed into one uint8 buffer per hop: one all-to-all and one all-gather."""
    x = _x((8, 64, 256), seed=8)
    for rd in ("hadamard", "signal"):
        hlo = _psum(mesh, codec=TACO, reduce_domain=rd).lower(x).compile().as_text()
        entry = hlo[hlo.index("\nENTRY"):]
        assert len(re.findall(r"[)}] all-to-all\(", entry)) == 1, rd
        assert len(re.findall(r"[)}] all-gather\(", entry)) == 1, rd


def _deps(hlo: str):
    """{instruction: set of operand names} and {instruction: line} of the entry computation."""
    entry = hlo[hlo.index("\nENTRY"):]
    ops, lines = {}, {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*?\((.*)", line)
        if m:
            ops[m.group(1)] = set(re.findall(r"%([\w.\-]+)", m.group(2)))
            lines[m.group(1)] = line
    return ops, lines


def _ancestors(ops, name, memo):
    if name not in memo:
        memo[name] = set()
        for o in ops.get(name, ()):
            memo[name] |= {o} | _ancestors(ops, o, memo)
    return memo[name]


#: custom-call targets of the "ffi" wire codec (`CodecConfig.wire`) -> the step they stand for
_PACKED_STEP = {"taco_encode_packed": "taco_encode", "taco_reduce_hadamard_packed": "taco_reduce",
                "taco_decode_packed": "taco_decode"}


@needs_ffi
@pytest.mark.parametrize("fused", [True, False], ids=["fused_wire", "unfused"])
def test_chunked_psum_has_independent_chains_in_compiled_hlo(mesh, fused):
    """K chunks compile to K encode -> all-to-all -> reduce -> all-gather -> decode chains with no
    data dependence between chains: every encode is ready before any transfer, so XLA's thunk
    executor may run chain i+1's codec work beside chain i's transfers."""
    codec = kernels.resolve_codec(dataclasses.replace(TACO, backend="ffi", wire="ffi" if fused else "generic"))
    x = _x((8, 64, 256), seed=7)
    hlo = _psum(mesh, codec=codec, reduce_domain="hadamard", chunks=2).lower(x).compile().as_text()
    ops, lines = _deps(hlo)
    kind = lambda name: (re.search(r'custom_call_target="(\w+)"', lines[name]) or  # noqa: E731
                         re.search(r"[)}] (all-to-all|all-gather)\(", lines[name]) or [None, None])[1]
    by = {}
    for name in ops:
        by.setdefault(_PACKED_STEP.get(kind(name), kind(name)), []).append(name)
    assert len(by["taco_encode"]) == len(by["taco_reduce"]) == len(by["taco_decode"]) == 2
    memo = {}
    transfers = set(by["all-to-all"]) | set(by["all-gather"])
    for enc in by["taco_encode"]:
        assert not (_ancestors(ops, enc, memo) & transfers), "an encode waits for a transfer"
    # each reduce depends on exactly one encode (its own chain's)
    for red in by["taco_reduce"]:
        assert len(_ancestors(ops, red, memo) & set(by["taco_encode"])) == 1


@needs_ffi
@pytest.mark.parametrize("fmt,g,layout,impl", [
    ("e4m3", 128, "dual", ffi_codec.IMPL_AUTO), ("e4m3", 128, "dual", ffi_codec.IMPL_SCALAR),
    ("e4m3", 32, "folded", ffi_codec.IMPL_AUTO), ("e5m2", 512, "dual", ffi_codec.IMPL_AUTO),
    ("e5m2", 64, "folded", ffi_codec.IMPL_SCALAR), ("e5m2", 256, "dual", ffi_codec.IMPL_AUTO),
])
def test_ffi_reduce_conforms_to_reference(fmt, g, layout, impl):
    """Conformance rule of `taco_jax.kernels` applied to `reduce_groups`: s within 2^-23 G
    (relative), at most 1e-3 of the codes differ; NaN groups -> NaN s."""
    cfg = dataclasses.replace(TACO, fmt=fmt, group_size=g, scale_layout=layout)
    key1, key2 = jax.random.split(jax.random.key(g))
    x = jax.random.normal(key1, (3, 24 * g)) * jnp.exp(jax.random.normal(key2, (3, 24 * g)))
    x = x.at[1, 5].set(jnp.nan).at[2, 3 * g + 1].set(jnp.inf)
    e = encode(x, cfg, batch_dims=1)
    rc, rs = map(np.asarray, reduce_groups(e.codes, e.scale, e.prescale, cfg))
    fc, fs = map(np.asarray, jax.jit(lambda c, s, a: ffi_codec.reduce_groups(c, s, a, cfg, impl=impl))(
        e.codes, e.scale, e.prescale))
    assert fc.dtype == rc.dtype and fc.shape == rc.shape and fs.shape == rs.shape
    fin = np.isfinite(rs)
    assert (~fin).sum() == 2 and np.isnan(fs[~fin]).all()
    np.testing.assert_allclose(fs[fin], rs[fin], rtol=2.0**-23 * g)
    assert (rc.view(np.uint8) != fc.view(np.uint8))[fin].mean() <= 1e-3
