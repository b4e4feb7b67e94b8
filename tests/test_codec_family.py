"""The codec family behind one interface: wire formats and bytes, every codec in every compressed collective,
non-finite policies inside jit + shard_map, and clear errors for bad configurations.

The per-kind expectations come from the kinds' registry (`taco_jax.codec.kinds`): the kinds, their code
format and bytes on the wire, and the one-quantization error bound used for the collectives
(`CodecKind.rounding`, per group of G, relative L2, worst case over the data; derived in
test_codec_properties.py): FP8 with m mantissa bits 2^-(m+1) + 2^-(d+1)·√G/R; symmetric integers with
L levels √G/(2L) (int8 √G/254, int4 √G/14); asymmetric √G/L (tah √G/15); a kind with one scale per
message (fp8_tensor) with G = the message size. A kind that declares no rounding fails.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import collectives as C
from taco_jax.codec import (
    NONE,
    CodecConfig,
    codec_kinds,
    decode,
    encode,
    get_kind,
    nonfinite_sites,
    raise_if_nonfinite,
    roundtrip,
)
from taco_jax.codec.family import pack4, unpack4
from taco_jax.codec.kinds import Rounding

pytestmark = pytest.mark.fast

KINDS = codec_kinds()[1:]
#: One codec per kind, exercising the options (axis, G, Hadamard, layout, format) across the set
#: (`test_every_registered_kind_has_a_rounding_and_a_codec_in_family`).
FAMILY = [
    CodecConfig(kind="fp8_tensor", fmt="e5m2"),
    CodecConfig(kind="fp8_group", group_size=64, group_axis="token"),
    CodecConfig(kind="int8", hadamard=True),
    CodecConfig(kind="int4", hadamard=True, group_size=32),
    CodecConfig(kind="taco", scale_layout="folded", group_axis="token", group_size=256),
    CodecConfig(kind="tah", group_size=512),
]
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def eps(c: CodecConfig, n: int) -> float:
    """Worst-case relative L2 error of one quantization of an `n`-element message by `c` (module
    docstring), from the kind's registered rounding."""
    spec = get_kind(c.kind)
    if spec.rounding is None:
        pytest.fail(f"codec kind {c.kind!r} declares no `rounding` (taco_jax/codec/kinds.py): its error cannot "
                    "be bounded")
    return spec.rounding.relative_l2(c, c.group_size if spec.grouped else n) + 1e-5


def bytes_per_element(c: CodecConfig) -> float:
    """Large-message wire bytes per element from the kind's entry: the code bits, plus the scale (and
    prescale) bytes of each group (none per element for one scale per message)."""
    spec = get_kind(c.kind)
    return spec.code_bits / 8 + (spec.scale_bytes(c) / c.group_size if spec.grouped else 0.0)


def test_every_registered_kind_has_a_rounding_and_a_codec_in_family():
    """The tables of this file and test_codec_properties.py come from the registry: a kind without its
    error model, or without a codec here, fails by name."""
    assert [k for k in KINDS if get_kind(k).rounding is None] == [], "declare the kinds' `rounding` (kinds.py)"
    assert sorted(c.kind for c in FAMILY) == sorted(KINDS), "add a codec of the new kind to FAMILY"
    with pytest.raises(ValueError, match="rounding grid 'int' does not match its codes"):
        dataclasses.replace(get_kind("taco"), rounding=Rounding("int", 7))
    with pytest.raises(ValueError, match="a positive L for grid 'int' only"):
        Rounding("fp8", 7)


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 1, shape[-1:])))


# ------------------------------------ wire format and bytes ------------------------------------


@pytest.mark.parametrize("cfg", FAMILY, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # all dtypes: test_codec_properties.py
@pytest.mark.cover(2)
def test_roundtrip_shape_dtype_and_bound(cfg, dtype):
    x = _x((5, 300), 1).astype(dtype)
    y = roundtrip(x, cfg)
    assert y.shape == x.shape and y.dtype == x.dtype
    x32, y32 = np.asarray(x, np.float32), np.asarray(y, np.float32)
    out_eps = {jnp.float32: 0, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}[dtype]
    assert 0 < np.linalg.norm(y32 - x32) <= (eps(cfg, x.size) + out_eps) * np.linalg.norm(x32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("g", [32, 128, 512])
@pytest.mark.cover(2)
def test_wire_buffers_and_bytes_per_element(kind, g):
    cfg = CodecConfig(kind=kind, group_size=g)
    x = _x((3, 333), 2)  # 999 elements: a partial last group for every G
    enc = encode(x, cfg)
    leaves = jax.tree.leaves(enc)
    spec = get_kind(kind)
    assert enc.codes.dtype == (FP8_DTYPES[cfg.fmt] if spec.fp8 else spec.code_dtype) == cfg.code_dtype
    if spec.grouped:
        assert enc.codes.shape[-1] == g * spec.code_bits // 8  # 4-bit codes: two per byte
    assert all(leaf.dtype.itemsize == 1 or leaf.dtype == jnp.float32 for leaf in leaves)
    assert enc.nbytes == pytest.approx(cfg.wire_bytes_per_element(n=x.size) * x.size)
    limit = bytes_per_element(cfg)
    assert cfg.wire_bytes_per_element() == pytest.approx(limit)


def test_named_wire_rates():
    assert CodecConfig(kind="taco", scale_layout="folded").wire_bytes_per_element() == 1 + 4 / 128  # spec §2
    assert NONE.wire_bytes_per_element(jnp.bfloat16) == 2.0
    assert CodecConfig(kind="fp8_tensor").wire_bytes_per_element(n=1000) == 1.004


def test_pack4_roundtrips_every_nibble_pair():
    q = jnp.asarray(np.stack(np.meshgrid(np.arange(16), np.arange(16)), -1).reshape(-1), jnp.uint8)
    packed = pack4(q)
    assert packed.shape == (256,) and len(set(np.asarray(packed).tolist())) == 256
    np.testing.assert_array_equal(unpack4(packed), q)


def test_int8_token_axis_scale_is_channel_absmax():
    x = _x((256, 8), 3)
    enc = encode(x, CodecConfig(kind="int8", group_axis="token"))
    np.testing.assert_allclose(enc.scale[0], np.abs(np.asarray(x)[:128, 0]).max() / 127, rtol=1e-6)


def test_int_codes_are_exact_for_representable_values():
    x = jnp.asarray(np.arange(-7, 8, dtype=np.float32).repeat(4)[:32] * 0.25)  # on int4's grid, absmax 1.75
    np.testing.assert_array_equal(roundtrip(x, CodecConfig(kind="int4", group_size=32)), x)


def test_fp16_decode_never_overflows_to_inf():
    x = jnp.full((4, 128), 65504.0, jnp.float16).at[:, ::3].set(-65504.0)
    for cfg in [CodecConfig(), CodecConfig(kind="int4", hadamard=True)]:
        assert np.all(np.isfinite(np.asarray(roundtrip(x, cfg), np.float32))), cfg.name


def test_jit_and_eager_agree_and_repeat():
    x = _x((8, 384), 4)
    for cfg in FAMILY[5:]:
        f = jax.jit(lambda v, c=cfg: roundtrip(v, c))
        np.testing.assert_array_equal(f(x), f(x + 0))
        np.testing.assert_allclose(f(x), roundtrip(x, cfg), rtol=1e-5, atol=eps(cfg, x.size) * float(jnp.abs(x).max()))


# -------------------------------- every codec in every collective --------------------------------


def _smap(mesh, fn, in_spec, out_spec):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec))


def _parts(x):  # [8, ...] sharded over (data, tensor) -> [data, tensor, ...]
    return np.asarray(x).reshape(2, 4, *x.shape[1:])


@pytest.mark.parametrize("codec", FAMILY, ids=lambda c: c.name)
def test_psum_two_shot_every_codec(mesh, codec):
    x = _x((8, 6, 100), 5)  # chunks flattened and padded
    out = np.asarray(_smap(mesh, lambda v: C.psum(v, "tensor", codec=codec), P(("data", "tensor")), P("data"))(x))
    parts = _parts(x)
    for d in range(2):
        s = parts[d].sum(0)
        e = eps(codec, x.size // 8)
        sum_norms = sum(np.linalg.norm(p) for p in parts[d])
        bound = e * sum_norms + e * (np.linalg.norm(s) + e * sum_norms)
        assert 0 < np.linalg.norm(out[d] - s) <= bound


@pytest.mark.parametrize("codec", FAMILY[2:4], ids=lambda c: c.name)
def test_psum_one_shot(mesh, codec):
    x = _x((8, 16, 64), 6)
    fn = functools.partial(C.psum, axis_name="tensor", codec=codec, algorithm="one_shot")
    out = np.asarray(_smap(mesh, lambda v: fn(v), P(("data", "tensor")), P("data"))(x)).reshape(2, 16, 64)
    parts = _parts(x)
    for d in range(2):
        err = np.linalg.norm(out[d] - parts[d].sum(0))
        assert 0 < err <= eps(codec, 16 * 64) * sum(np.linalg.norm(p) for p in parts[d])


@pytest.mark.parametrize("codec", FAMILY, ids=lambda c: c.name)
def test_all_gather_psum_scatter_ppermute_every_codec(mesh, codec):
    x = _x((32, 16, 128), 7)
    spec = P(("data", "tensor"))
    ag = _smap(mesh, lambda v: C.all_gather(v, "tensor", codec=codec, axis=1, tiled=True), spec, spec)(x)
    ag_ref = _smap(mesh, lambda v: jax.lax.all_gather(v, "tensor", axis=1, tiled=True), spec, spec)(x)
    assert 0 < np.linalg.norm(ag - ag_ref) <= eps(codec, 4 * 16 * 128) * np.linalg.norm(ag_ref)
    rs = _smap(mesh, lambda v: C.psum_scatter(v, "tensor", codec=codec, scatter_dimension=1), spec, spec)(x)
    rs_ref = _smap(mesh, lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=1, tiled=True), spec, spec)(x)
    sum_norms = np.sum(np.linalg.norm(np.asarray(x).reshape(8, -1), axis=1))
    assert 0 < np.linalg.norm(rs - rs_ref) <= eps(codec, 4 * 4 * 128) * sum_norms
    perm = [(i, (i + 1) % 4) for i in range(4)]
    pp = _smap(mesh, lambda v: C.ppermute(v, "tensor", perm, codec=codec), spec, spec)(x)
    pp_ref = _smap(mesh, lambda v: jax.lax.ppermute(v, "tensor", perm), spec, spec)(x)
    assert 0 < np.linalg.norm(pp - pp_ref) <= eps(codec, 4 * 16 * 128) * np.linalg.norm(pp_ref)


def test_int4_moves_half_the_bytes_of_int8(mesh):
    from taco_jax.collectives.hlo import collective_bytes

    x = _x((8, 64, 256), 8)

    def tensor_bytes(codec):
        f = _smap(mesh, lambda v: C.psum(v, "tensor", codec=codec), P(("data", "tensor")), P("data"))
        rows = collective_bytes(f.lower(x).compile().as_text(), mesh)["detail"]
        return sum(r["bytes"] for r in rows if r["axis"] == "tensor")

    ratio = tensor_bytes(CodecConfig(kind="int4")) / tensor_bytes(CodecConfig(kind="int8"))
    assert ratio == pytest.approx((0.5 + 4 / 128) / (1 + 4 / 128), rel=1e-3)


@pytest.mark.parametrize("codec", FAMILY, ids=lambda c: c.name)
def test_nan_in_psum_stays_nan(mesh, codec):
    x = _x((8, 16, 128), 9).at[1, 0, 0].set(jnp.nan)  # data 0, tensor rank 1
    out = np.asarray(_smap(mesh, lambda v: C.psum(v, "tensor", codec=codec), P(("data", "tensor")), P("data"))(x))
    assert np.isnan(out[0, 0, 0])
    assert np.all(np.isfinite(out[1]))  # the other data group never saw it


# -------------------------------------- non-finite: "error" --------------------------------------


def _mlp_loss(mesh, policy):
    def local(x, w1, w2):
        h = C.copy_to_tp(x, "tensor", policy)
        y = C.reduce_from_tp(jnp.tanh(h @ w1) @ w2, "tensor", policy)
        return jax.lax.pmean(jnp.sum(jnp.sin(y)), "data")

    return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(None, "tensor"), P("tensor", None)), out_specs=P())


def _raises_naming(fn, site):
    jax.block_until_ready(fn())  # the step itself completes (values follow "propagate")
    with pytest.raises(FloatingPointError, match=rf"site\(s\) \[{site!r}"):
        raise_if_nonfinite()
    assert nonfinite_sites() == []  # raising cleared the reports


def test_error_policy_raises_naming_the_site_inside_jit_shard_map_and_grad(mesh):
    x, w1, w2 = _x((4, 8, 64), 10) / 4, _x((64, 128), 11) / 32, _x((128, 64), 12) / 11
    checked = CodecConfig(kind="int8", nonfinite="error")
    pol = C.CommPolicy(ar_fwd=checked, ar_bwd=checked)
    grad = jax.jit(jax.grad(_mlp_loss(mesh, pol), argnums=(0, 1, 2)))
    plain_pol = C.CommPolicy(ar_fwd=CodecConfig(kind="int8"), ar_bwd=CodecConfig(kind="int8"))
    plain = jax.jit(jax.grad(_mlp_loss(mesh, plain_pol), argnums=(0, 1, 2)))
    for g, want in zip(grad(x, w1, w2), plain(x, w1, w2), strict=True):  # finite: same numbers as "propagate"
        np.testing.assert_array_equal(g, want)
    _raises_naming(lambda: grad(x.at[0, 0, 0].set(jnp.nan), w1, w2), "ar_fwd")


def test_error_policy_names_backward_site(mesh):
    checked = CodecConfig(nonfinite="error")
    pol = C.CommPolicy(ar_bwd=checked)  # forward exact; only the backward all-reduce is checked
    x, w1, w2 = _x((4, 8, 64), 13) / 4, _x((64, 128), 14) / 32, _x((128, 64), 15) / 11

    def loss(x, w1, w2, scale):
        return _mlp_loss(mesh, pol)(x, w1, w2) * scale

    grad = jax.jit(jax.grad(loss, argnums=(0,)))
    _raises_naming(lambda: grad(x, w1, w2, jnp.float32(np.inf)), "ar_bwd")


def test_codec_for_names_the_site_only_for_error_policy():
    pol = C.CommPolicy(ar_fwd=CodecConfig(nonfinite="error"), ar_bwd=CodecConfig())
    x = jnp.ones((4, 4))
    assert pol.codec_for("ar_fwd", x).site == "ar_fwd"
    assert pol.codec_for("ar_bwd", x) is pol.ar_bwd


# ------------------------------------------ bad input ------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="int2"), "kind='int2'"),
        (dict(kind="int8", group_size=96), "group_size=96"),
        (dict(kind="tah", group_axis="batch"), "group_axis='batch'"),
        (dict(kind="fp8_tensor", group_axis="token"), "group_axis='token'"),
        (dict(kind="taco", hadamard=True), "hadamard=True"),
        (dict(kind="int8", scale_layout="folded"), "scale_layout='folded'"),
        (dict(nonfinite="raise"), "nonfinite='raise'"),
    ],
)
def test_bad_codec_config_raises_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodecConfig(**kwargs)


def test_encode_rejects_none_and_bad_messages():
    with pytest.raises(ValueError, match="kind='none'"):
        encode(jnp.ones(4), NONE)
    with pytest.raises(ValueError, match="floating-point"):
        encode(jnp.ones(4, jnp.int32), CodecConfig(kind="int4"))


ZERO_SIZE_CODECS = [CodecConfig(kind=k) for k in KINDS] + [
    CodecConfig(scale_layout="folded"), CodecConfig(kind="int8", group_axis="token")]


@pytest.mark.parametrize("cfg", ZERO_SIZE_CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize(("shape", "batch_dims"), [((0, 128), 0), ((0,), 0), ((3, 0, 4), 1), ((0, 4, 64), 1)])
def test_zero_size_input_encodes_to_empty_buffers_and_decodes_to_its_shape(cfg, shape, batch_dims):
    """An empty message (or an empty batch of messages) is no error: zero wire bytes, and
    decode gives back the empty shape and dtype; buffers have the layout a non-empty input gets."""
    x = jnp.zeros(shape, jnp.bfloat16)
    enc = jax.jit(lambda v: encode(v, cfg, batch_dims=batch_dims))(x)
    assert enc.nbytes == 0
    assert enc.codes.dtype == cfg.code_dtype and enc.shape == shape[batch_dims:]
    one = jax.eval_shape(lambda v: encode(v, cfg, batch_dims=batch_dims), jnp.zeros((1,) * batch_dims + (5, 64)))
    assert enc.codes.ndim == one.codes.ndim and (enc.prescale is None) == (one.prescale is None)
    if shape[0] == 0 and batch_dims:  # no messages, each of 4 x 64: one message's group layout
        full = jax.eval_shape(lambda v: encode(v, cfg, batch_dims=1), jnp.zeros((1, *shape[1:])))
        assert enc.codes.shape[1:] == full.codes.shape[1:]
    out = jax.jit(lambda e: decode(e, cfg))(enc)
    assert out.shape == shape and out.dtype == jnp.bfloat16


def test_decode_default_dtype_is_the_encoded_dtype():
    x = _x((4, 64), 16).astype(jnp.bfloat16)
    cfg = CodecConfig(kind="int8")
    assert decode(encode(x, cfg), cfg).dtype == jnp.bfloat16
    assert decode(encode(x, cfg), cfg, jnp.float32).dtype == jnp.float32
