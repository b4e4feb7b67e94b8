"""The "ffi" wire codec (packed rows written and read by the C++ FFI kernels on CPU) against the generic one.

1. Each packed FFI target (`ffi_codec.encode_packed` ...) equals, byte for byte / bit for bit, the
   generic composition it replaces: `encode_groups` + `codec.wire.pack_rows`, `decode_groups`,
   `codec.wire.sum_fp32`, `reduce_groups`; both kernels (impl 0 / 1), partial last groups, NaN/Inf.
2. Every compressed collective gives bit-identical values (and gradients) with `CodecConfig.wire`
   "ffi" (fused) and "generic" (unfused).
3. The compiled fused two-shot psum has no concatenation around its transfers.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from taco_jax.codec import TACO, decode, encode, reduce_encoded, resolve_codec, wire_for
from taco_jax.codec import wire as generic_wire
from taco_jax.codec.backends import default_platform
from taco_jax.collectives import compressed
from taco_jax.kernels import ffi_codec

FFI_REASON = ffi_codec.unavailable_reason("cpu") if default_platform() == "cpu" else "not running on CPU"
pytestmark = [pytest.mark.fast, pytest.mark.skipif(
    FFI_REASON is not None, reason=f"fused wire path needs the CPU FFI codec library: {FFI_REASON}")]
# the scalar kernel is bit-identical to the AVX2 one (tests/test_kernels.py); here in `make test` (not `make test-fast`)
IMPLS = (ffi_codec.IMPL_AUTO, pytest.param(ffi_codec.IMPL_SCALAR, marks=pytest.mark.slow, id="1"))


def _cfg(fmt="e4m3", g=128, layout="dual"):
    return dataclasses.replace(TACO, backend="ffi", fmt=fmt, group_size=g, scale_layout=layout)


def _x(shape, seed=0, nonfinite=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 2, shape)).astype(np.float32)
    if nonfinite and shape[0] >= 3:
        x[1, 3] = np.nan
        x[2, -1] = np.inf  # in the last (maybe partial) group
    return jnp.asarray(x)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if a.dtype == np.uint8:
        np.testing.assert_array_equal(a, b)
    else:  # bit for bit, NaNs included (same bits as well)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _wired(cfg, fused: bool):
    """`cfg` with the "ffi" wire codec (fused) or the generic one."""
    return dataclasses.replace(cfg, wire="ffi" if fused else "generic")


def _grads_fused_and_unfused(make, cfg, x, p, *, seed):
    """d/dx of sum(w * body(x)) (w random, fixed; body = make(codec)) inside shard_map over P ranks,
    with the "ffi" wire codec, then the generic one."""
    mesh = Mesh(np.array(jax.devices()[:p]), ("t",))
    out = jax.eval_shape(jax.shard_map(make(cfg), mesh=mesh, in_specs=P("t"), out_specs=P("t")), x)
    w = _x(out.shape, seed=seed, nonfinite=False)

    def grad(fused):
        body = make(_wired(cfg, fused))
        f = jax.shard_map(lambda v, u: jax.lax.psum(jnp.sum(u * body(v)), "t"), mesh=mesh,
                          in_specs=(P("t"), P("t")), out_specs=P())
        return jax.jit(jax.grad(lambda v: f(v, w)))(x)

    return grad(True), grad(False)


def _unfused_rows(x, cfg, batch_dims=1):
    """The uint8 wire buffer the generic wire codec builds: encode + `pack_rows`."""
    return generic_wire.pack_rows(encode(x, cfg, batch_dims=batch_dims), batch_dims)


def _decoded(rows, cfg, m, has_a=True, dtype=jnp.float32):
    """Generic decode of packed rows [..., row_bytes] -> [..., m]: `unpack_rows` + decode."""
    dec_cfg = cfg if has_a else dataclasses.replace(cfg, scale_layout="folded")
    return decode(generic_wire.unpack_rows(rows, dec_cfg, (m,), jnp.float32), dec_cfg, dtype)


CASES = [("e4m3", 32, "dual", 100), ("e4m3", 128, "folded", 1024), ("e5m2", 512, "dual", 700),
         ("e5m2", 128, "folded", 300), ("e4m3", 512, "folded", 2048), ("e5m2", 32, "dual", 64)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt,g,layout,m", CASES, ids=str)
def test_packed_targets_equal_unfused_composition(fmt, g, layout, m, impl):
    cfg = _cfg(fmt, g, layout)
    p = 3
    x = _x((p, m), seed=g + m)
    want_rows = jax.jit(lambda v: _unfused_rows(v, cfg))(x)
    rows = jax.jit(lambda v: ffi_codec.encode_packed(v, cfg, impl=impl))(x)
    _same(rows, want_rows)
    assert rows.shape[-1] == ffi_codec.packed_row_bytes(m, cfg)

    # decode and decode-sum, rank order
    dec = jax.jit(lambda r: ffi_codec.decode_packed(r, cfg, m, impl=impl))(rows)
    want_dec = jax.jit(lambda r: _decoded(r, cfg, m))(rows)
    _same(dec, want_dec)
    assert np.isnan(np.asarray(dec)[1]).any() and np.isnan(np.asarray(dec)[2]).any()
    tot = jax.jit(lambda r: ffi_codec.decode_sum_packed(r, cfg, m, impl=impl))(rows)
    _same(tot, jax.jit(lambda d: generic_wire.sum_fp32(d, jnp.float32))(want_dec))

    # one buffer per destination (split) and one operand per source rank: the same bytes
    parts = ffi_codec.encode_packed(x, cfg, split=True, impl=impl)
    assert len(parts) == p
    for r in range(p):
        _same(parts[r], rows[r])
    ranks = [rows[r] for r in range(p)]
    _same(ffi_codec.decode_sum_packed(ranks, cfg, m, impl=impl), tot)
    _same(ffi_codec.reduce_packed(ranks, cfg, m, impl=impl), ffi_codec.reduce_packed(rows, cfg, m, impl=impl))
    _same(ffi_codec.reduce_hadamard_packed(ranks, cfg, m, impl=impl),
          ffi_codec.reduce_hadamard_packed(rows, cfg, m, impl=impl))

    # signal-domain reduce on finite rows (the NaN one leaves nothing to compare but NaN)
    xf = _x((p, m), seed=g + m + 1, nonfinite=False)
    rf = ffi_codec.encode_packed(xf, cfg)
    red = jax.jit(lambda r: ffi_codec.reduce_packed(r, cfg, m, impl=impl))(rf)
    want_red = jax.jit(lambda r: _unfused_rows(generic_wire.sum_fp32(_decoded(r, cfg, m), jnp.float32), cfg, 0))(rf)
    _same(red, want_red)
    red_nan = np.asarray(ffi_codec.reduce_packed(rows, cfg, m, impl=impl))
    assert np.isnan(np.asarray(ffi_codec.decode_packed(jnp.asarray(red_nan), cfg, m))).any()

    # transform-domain reduce, folded output
    had = jax.jit(lambda r: ffi_codec.reduce_hadamard_packed(r, cfg, m, impl=impl))(rows)
    want_had = jax.jit(lambda v: generic_wire.pack_rows(reduce_encoded(encode(v, cfg, batch_dims=1), cfg), 0))(x)
    _same(had, want_had)
    assert had.shape[-1] == ffi_codec.packed_row_bytes(m, cfg, has_a=False)
    hd = ffi_codec.decode_packed(had, cfg, m, has_a=False, impl=impl)
    _same(hd, _decoded(had, cfg, m, has_a=False))
    assert np.isnan(np.asarray(hd)).any()


def test_scalar_and_auto_kernels_agree_on_large_rows():
    """Rows big enough for several work items per row and streaming stores (impl 0) still match impl 1."""
    cfg = _cfg("e4m3", 256, "dual")
    m = 3 * 256 * 300 + 17
    x = _x((2, m), seed=3)
    a = ffi_codec.encode_packed(x, cfg, impl=ffi_codec.IMPL_AUTO)
    b = ffi_codec.encode_packed(x, cfg, impl=ffi_codec.IMPL_SCALAR)
    _same(a, b)
    _same(ffi_codec.reduce_packed(a, cfg, m), ffi_codec.reduce_packed(a, cfg, m, impl=ffi_codec.IMPL_SCALAR))


def test_packed_targets_under_vmap():
    """An extra leading (vmapped) axis: the handlers flatten it, results equal the per-slice calls."""
    cfg, m = _cfg("e4m3", 32, "folded"), 70
    x = _x((2, 3, m), seed=9, nonfinite=False)
    rows = jax.vmap(lambda v: ffi_codec.encode_packed(v, cfg))(x)
    parts = jax.vmap(lambda v: ffi_codec.encode_packed(v, cfg, split=True))(x)
    for b in range(2):
        _same(rows[b], ffi_codec.encode_packed(x[b], cfg))
        for r in range(3):
            _same(parts[r][b], rows[b, r])
    _same(jax.vmap(lambda r: ffi_codec.decode_sum_packed(r, cfg, m))(rows),
          jnp.stack([ffi_codec.decode_sum_packed(rows[b], cfg, m) for b in range(2)]))
    _same(jax.vmap(lambda *r: ffi_codec.reduce_packed(list(r), cfg, m))(*parts),
          jnp.stack([ffi_codec.reduce_packed(rows[b], cfg, m) for b in range(2)]))


def test_bad_packed_input_raises():
    cfg = _cfg()
    rows = ffi_codec.encode_packed(jnp.ones((2, 256)), cfg)
    with pytest.raises(ValueError, match="last axis"):
        ffi_codec.decode_packed(rows, cfg, 100)
    with pytest.raises(ValueError, match="uint8"):
        ffi_codec.decode_sum_packed(rows.astype(jnp.int8), cfg, 256)
    with pytest.raises(ValueError, match="m=0"):
        ffi_codec.encode_packed(jnp.ones((2, 0)), cfg)
    with pytest.raises(ValueError, match="one shape"):
        ffi_codec.reduce_packed([rows[0], rows], cfg, 256)
    with pytest.raises(ValueError, match="kind"):
        ffi_codec.encode_packed(jnp.ones((2, 8)), dataclasses.replace(cfg, kind="fp8_group"))


# --------------------------------------------------------------------------------------------
# collectives: wire "ffi" vs "generic" (each `make(codec)` gives the per-rank function)
# --------------------------------------------------------------------------------------------


def _run(make, cfg, fused, x, p):
    mesh = Mesh(np.array(jax.devices()[:p]), ("t",))
    f = jax.jit(jax.shard_map(make(_wired(cfg, fused)), mesh=mesh, in_specs=P("t"), out_specs=P("t")))
    return f(x)


def _both(make, cfg, x, p):
    a = _run(make, cfg, True, x, p)
    b = _run(make, cfg, False, x, p)
    _same(a, b)
    return a


def _hlo(make, cfg, fused, x, p):
    mesh = Mesh(np.array(jax.devices()[:p]), ("t",))
    fn = make(_wired(cfg, fused))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("t"), out_specs=P("t"))).lower(x).compile().as_text()


COLLECTIVES = {
    "two_shot": lambda c: (lambda v: compressed.psum(v, "t", codec=c)[None]),
    "two_shot_hadamard": lambda c: (lambda v: compressed.psum(v, "t", codec=c, reduce_domain="hadamard")[None]),
    "two_shot_chunks2": lambda c: (lambda v: compressed.psum(v, "t", codec=c, chunks=2)[None]),
    "hadamard_chunks2": lambda c: (lambda v: compressed.psum(v, "t", codec=c, chunks=2,
                                                             reduce_domain="hadamard")[None]),
    "one_shot": lambda c: (lambda v: compressed.psum(v, "t", codec=c, algorithm="one_shot")[None]),
    "psum_scatter": lambda c: (lambda v: compressed.psum_scatter(v, "t", codec=c)),
    "all_gather": lambda c: (lambda v: compressed.all_gather(v, "t", codec=c, tiled=True)),
    # a shift that leaves rank 0 without a sender (it receives zeros)
    "ppermute": lambda c: (lambda v: compressed.ppermute(
        v, "t", [(i, i + 1) for i in range(jax.lax.axis_size("t") - 1)], codec=c)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("p,rows,cols,layout", [(2, 8, 256, "dual"), (4, 12, 100, "folded"), (2, 6, 45, "dual"),
                                                (4, 8, 512, "dual")], ids=str)
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
@pytest.mark.cover(4)
def test_collectives_bit_identical_fused_vs_unfused(name, p, rows, cols, layout, dtype):
    cfg = _cfg("e4m3" if cols % 2 == 0 else "e5m2", 32 if cols < 128 else 128, layout)
    x = _x((p * rows, cols), seed=rows + cols).astype(dtype)  # holds a NaN and an Inf (rank 0)
    x = x.at[p * rows - 1, 0].set(jnp.nan)  # and a NaN on the last rank
    _both(COLLECTIVES[name], cfg, x, p)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt,layout", [("e4m3", "dual"), ("e5m2", "folded")])
def test_two_shot_overflow_bit_identical_fused_vs_unfused(fmt, layout, impl):
    """float16 sums that overflow in some elements (issue 52): the C++ reducer writes, and the C++
    decoder reads, the overflow groups (`codec.dispatch.overflow_groups`) byte for byte and bit for
    bit as the generic wire codec: ±Inf in those elements, the rest of their groups finite."""
    p, m, cfg = 4, 256, _cfg(fmt, 32, layout)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 100, (p * 4, m)).astype(np.float32)
    x[:, 5], x[:, 6], x[:, 70] = 20000.0, 15000.0, -20000.0  # +Inf, 60000, -Inf in every chunk's sum
    x = jnp.asarray(x, jnp.float16)
    got = np.asarray(_both(COLLECTIVES["two_shot"], cfg, x, p), np.float32)  # [P, 4, m], equal on every rank
    assert np.isposinf(got[..., 5]).all() and np.isneginf(got[..., 70]).all()
    assert np.isinf(got).sum() == 2 * got[..., 0].size and not np.isnan(got).any()
    rows = ffi_codec.encode_packed(x.reshape(p, -1), cfg)  # the kernel levels agree on the overflow groups too
    red = ffi_codec.reduce_packed(rows, cfg, 4 * m, impl=impl, dtype=jnp.float16)
    _same(red, jax.jit(lambda r: generic_wire.reduce_rows(r, cfg, (4 * m,), jnp.float16, "signal"))(rows))
    _same(ffi_codec.decode_packed(red[None], cfg, 4 * m, impl=impl, dtype=jnp.float16),
          generic_wire.decode_rows(red[None], cfg, (4 * m,), jnp.float16, overflow=True))


@pytest.mark.parametrize("name", ["psum_scatter", "all_gather"])
def test_gradients_bit_identical_fused_vs_unfused(name):
    p, cfg = 4, _cfg("e4m3", 32, "dual")
    x = _x((p * 8, 40), seed=11, nonfinite=False)
    _same(*_grads_fused_and_unfused(COLLECTIVES[name], cfg, x, p, seed=12))


@pytest.mark.filterwarnings("ignore:codec backend 'auto' on cuda")
def test_auto_resolves_to_the_ffi_wire_codec():
    """`auto` resolves to ffi here, so the default TACO codec uses the packed targets; codecs whose
    rows the kernels do not write, and messages they do not take, use the generic wire codec."""
    x = jnp.ones((4, 256))
    assert resolve_codec(TACO).wire == "ffi"
    assert wire_for(TACO, x).per_source  # "auto" resolved at trace time: the ffi wire codec
    assert resolve_codec(dataclasses.replace(TACO, backend="reference")).wire == "generic"
    assert resolve_codec(dataclasses.replace(TACO, backend="ffi", group_axis="token")).wire == "generic"
    assert resolve_codec(dataclasses.replace(TACO, backend="ffi", nonfinite="zero")).wire == "generic"
    assert resolve_codec(dataclasses.replace(TACO, kind="int8")).wire == "generic"
    assert wire_for(_cfg(), jnp.ones((0, 4))) is generic_wire.GENERIC
    assert wire_for(_wired(_cfg(), True), jnp.ones((4, 256), jnp.int32)) is generic_wire.GENERIC
    with pytest.raises(ValueError, match="wire='ffi' needs kind='taco'"):
        dataclasses.replace(_cfg(), wire="ffi", nonfinite="zero")
    with pytest.raises(ValueError, match="wire='ffi' cannot run"):
        resolve_codec(dataclasses.replace(TACO, wire="ffi"), "cuda")


def _ops(hlo: str) -> dict:
    """{opcode: count} of the ENTRY computation of compiled HLO text."""
    entry = hlo[hlo.index("\nENTRY"):]
    ops = re.findall(r"^\s*(?:ROOT )?%\S+ = (?:\(.*?\)|\S+) ([\w-]+)\(", entry, flags=re.M)
    return {op: ops.count(op) for op in set(ops)}


@pytest.mark.parametrize("reduce_domain", ["signal", "hadamard"])
def test_fused_two_shot_moves_wire_rows_without_copies(reduce_domain):
    """The compiled fused two-shot psum is custom calls, collectives and bitcasts only: no
    concatenation, slice or elementwise fusion (copy) around the all-to-all and all-gather."""
    cfg = _cfg()
    x = _x((2 * 64, 256), seed=5, nonfinite=False)
    make = lambda c: (lambda v: compressed.psum(v, "t", codec=c, reduce_domain=reduce_domain)[None])  # noqa: E731
    fused = _hlo(make, cfg, True, x, 2)
    ops = _ops(fused)
    assert set(ops) <= {"parameter", "bitcast", "custom-call", "get-tuple-element", "all-to-all", "all-gather"}, ops
    assert ops["custom-call"] == 3 and ops["all-to-all"] == 1 and ops["all-gather"] == 1, ops
    reducer = "taco_reduce_packed" if reduce_domain == "signal" else "taco_reduce_hadamard_packed"
    for t in ("taco_encode_packed", reducer, "taco_decode_packed"):
        assert f'custom_call_target="{t}"' in fused, t
    unfused = _ops(_hlo(make, cfg, False, x, 2))
    assert unfused.get("concatenate", 0) > 0 and unfused.get("fusion", 0) > 0  # what the fused path removes


# --------------------------------------------------------------------------------------------
# sequence parallelism: all-gather / reduce-scatter along a non-leading axis without transposes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("outer,p,inner,layout", [(3, 2, 64, "dual"), (1, 4, 128, "folded"), (5, 3, 32, "dual")],
                         ids=str)
def test_interleaved_packed_targets_equal_transposed(outer, p, inner, layout, impl):
    """encode_packed(interleaved) reads [outer, P, inner] as the P messages x[:, r, :];
    decode_packed(outer=k) writes row r's message to [k, r, :]: equal to the transposes."""
    cfg = _cfg("e4m3", 32, layout)
    x = _x((outer, p, inner), seed=outer + p + inner, nonfinite=False).at[0, p - 1, 5].set(jnp.nan)
    msgs = jnp.swapaxes(x, 0, 1).reshape(p, outer * inner)
    want = ffi_codec.encode_packed(msgs, cfg, impl=impl)
    _same(ffi_codec.encode_packed(x, cfg, interleaved=True, impl=impl), want)
    parts = jax.jit(lambda v: ffi_codec.encode_packed(v, cfg, split=True, interleaved=True, impl=impl))(x)
    for r in range(p):
        _same(parts[r], want[r])
    dec = jax.jit(lambda r: ffi_codec.decode_packed(r, cfg, outer * inner, outer=outer, impl=impl))(want)
    plain = ffi_codec.decode_packed(want, cfg, outer * inner, impl=impl)
    _same(dec, jnp.swapaxes(plain.reshape(p, outer, inner), 0, 1))
    # under vmap (the handlers flatten the extra leading axis)
    xs = jnp.stack([x, 2 * x])
    _same(jax.vmap(lambda v: ffi_codec.encode_packed(v, cfg, interleaved=True, impl=impl))(xs),
          jnp.stack([want, ffi_codec.encode_packed(2 * msgs, cfg, impl=impl)]))
    rows2 = jnp.stack([want, want])
    _same(jax.vmap(lambda r: ffi_codec.decode_packed(r, cfg, outer * inner, outer=outer, impl=impl))(rows2),
          jnp.stack([dec, dec]))


def test_interleaved_bad_input_raises():
    cfg = _cfg("e4m3", 32)
    with pytest.raises(ValueError, match="multiple of G=32"):
        ffi_codec.encode_packed(jnp.ones((2, 2, 40)), cfg, interleaved=True)
    with pytest.raises(ValueError, match="outer"):
        ffi_codec.encode_packed(jnp.ones((2, 64)), cfg, interleaved=True)
    rows = ffi_codec.encode_packed(jnp.ones((2, 96)), cfg)
    with pytest.raises(ValueError, match="outer=2"):
        ffi_codec.decode_packed(rows, cfg, 96, outer=2)  # 96 is not a multiple of 2 * 32


def _sp_fn(kind, dim, cfg):
    if kind == "all_gather":
        return lambda v: compressed.all_gather(v, "t", codec=cfg, axis=dim, tiled=True)
    if kind == "all_gather_untiled":
        return lambda v: compressed.all_gather(v, "t", codec=cfg, axis=dim, tiled=False)
    if kind == "psum_scatter":
        return lambda v: compressed.psum_scatter(v, "t", codec=cfg, scatter_dimension=dim)
    return lambda v: compressed.psum_scatter(v, "t", codec=cfg, scatter_dimension=dim, tiled=False)


# per-rank shapes [b, t, d] / dims; inner % G == 0 (fused, no transpose) and != 0 (transposing fallback)
SP_SHAPES = [((2, 8, 64), 1), ((3, 4, 40), 1), ((2, 3, 8, 32), 2), ((2, 8, 16), 2)]


@pytest.mark.parametrize("p,dtype", [(2, jnp.float32), (4, jnp.bfloat16),  # the other two not in `make test-fast`
                                     pytest.param(2, jnp.bfloat16, marks=pytest.mark.slow),
                                     pytest.param(4, jnp.float32, marks=pytest.mark.slow)],
                         ids=lambda v: jnp.dtype(v).name if not isinstance(v, int) else str(v))
@pytest.mark.parametrize("shape,dim", SP_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["all_gather", "all_gather_untiled", "psum_scatter", "psum_scatter_untiled"])
@pytest.mark.cover(4)
def test_sp_collectives_bit_identical_fused_vs_unfused(kind, shape, dim, p, dtype):
    cfg = _cfg("e4m3", 32, "dual")
    shape = list(shape)
    if kind == "psum_scatter":
        shape[dim] *= p
    elif kind == "psum_scatter_untiled":
        shape[dim] = p
    x = _x((p * shape[0], *shape[1:]), seed=sum(shape) + p, nonfinite=False).astype(dtype)
    x = x.at[0, 1, 2].set(jnp.nan).at[-1, 0, -1].set(jnp.inf)
    _both(lambda c: _sp_fn(kind, dim, c), cfg, x, p)


@pytest.mark.parametrize("dim", [1, 2])
def test_psum_scatter_message_layout(dim):
    """Reduce-scatter along dim: rank r's message from rank q is x_q viewed [outer, P, inner] at
    [:, r, :] (flattened), decoded and summed in FP32 in rank order (the documented layout)."""
    p, cfg = 2, _cfg("e4m3", 32, "folded")
    per = (3, 4, 32) if dim == 1 else (3, 2, 8)
    x = _x((p * per[0], *per[1:]), seed=21, nonfinite=False)
    mesh = Mesh(np.array(jax.devices()[:p]), ("t",))
    got = jax.jit(jax.shard_map(_sp_fn("psum_scatter", dim, cfg), mesh=mesh, in_specs=P("t"),
                                out_specs=P("t")))(x)
    xs = np.asarray(x).reshape(p, *per)  # [rank q, *per]
    outer = int(np.prod(per[:dim]))
    inner = int(np.prod(per[dim:])) // p
    for r in range(p):
        msgs = jnp.asarray(xs.reshape(p, outer, p, inner)[:, :, r, :].reshape(p, -1))  # [q, m]
        want = generic_wire.sum_fp32(decode(encode(msgs, cfg, batch_dims=1), cfg, jnp.float32), jnp.float32)
        shard = np.asarray(got).reshape(p, *per[:dim], per[dim] // p, *per[dim + 1:])[r]
        _same(shard.reshape(-1), want)


@pytest.mark.parametrize("kind", ["all_gather", "psum_scatter"])
@pytest.mark.parametrize("p", [2, 4])
def test_sp_gradients_bit_identical_fused_vs_unfused(kind, p):
    """jax.grad through all_gather / psum_scatter along dim 1 (backward: the other one along dim 1)."""
    cfg = _cfg("e4m3", 32, "dual")
    per = (2, 8 * (p if kind == "psum_scatter" else 1), 32)
    x = _x((p * per[0], *per[1:]), seed=31, nonfinite=False)
    g, g_unfused = _grads_fused_and_unfused(lambda c: _sp_fn(kind, 1, c), cfg, x, p, seed=32)
    _same(g, g_unfused)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0


@pytest.mark.parametrize("kind", ["all_gather", "psum_scatter"])
def test_fused_sp_collectives_have_no_transpose(kind):
    """Compiled fused all_gather(axis=1) / psum_scatter(dim=1) of [8, 64, 32] f32 per rank (P=2,
    G=128): custom calls, the collective and bitcasts only: no transpose and no copy fusion."""
    cfg = _cfg("e4m3", 128, "dual")
    x = _x((2 * 8, 64, 32), seed=41, nonfinite=False)
    make = lambda c: _sp_fn(kind, 1, c)  # noqa: E731
    hlo = _hlo(make, cfg, True, x, 2)
    ops = _ops(hlo)
    coll = "all-gather" if kind == "all_gather" else "all-to-all"
    assert set(ops) <= {"parameter", "bitcast", "custom-call", "get-tuple-element", coll}, ops
    assert not re.search(r"= \S+ (transpose|copy)\(", hlo) and "fusion" not in ops, ops  # any computation
    assert ops["custom-call"] == 2 and ops[coll] == 1, ops
    unfused = _ops(_hlo(make, cfg, False, x, 2))
    assert unfused.get("transpose", 0) + unfused.get("fusion", 0) + unfused.get("copy", 0) > 0, unfused


def test_auto_backend_hadamard_psum_same_fused_and_unfused():
    """backend "auto" (the default): the generic transform-domain reduction resolves "auto" too, so it
    runs the same C++ reduction as the ffi wire codec (bit-identical results either way)."""
    cfg = dataclasses.replace(TACO)  # backend "auto"
    assert cfg.backend == "auto"
    x = _x((4 * 4, 512), seed=51, nonfinite=False)
    mesh = Mesh(np.array(jax.devices()[:4]), ("t",))
    got = {}
    for fused in (True, False):
        c = _wired(cfg, fused)
        f = jax.shard_map(lambda v, c=c: compressed.psum(v, "t", codec=c, reduce_domain="hadamard"), mesh=mesh,
                          in_specs=P("t"), out_specs=P())
        got[fused] = jax.jit(f)(x)
    _same(got[True], got[False])


@pytest.mark.parametrize("nonfinite", ["zero", "propagate"])  # "zero" takes the generic wire codec
def test_vmap_of_hadamard_psum(nonfinite):
    """vmap over a transform-domain psum: the C++ reduction takes the batch axis vmap adds."""
    cfg = dataclasses.replace(_cfg(), nonfinite=nonfinite)
    x = _x((3, 4 * 8, 8 * 128), seed=52, nonfinite=False)
    mesh = Mesh(np.array(jax.devices()[:4]), ("t",))
    f = jax.shard_map(jax.vmap(lambda u: compressed.psum(u, "t", codec=cfg, reduce_domain="hadamard")),
                      mesh=mesh, in_specs=P(None, "t"), out_specs=P(None))
    y = np.asarray(jax.jit(f)(x))
    want = np.asarray(x).reshape(3, 4, 8, -1).sum(1)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 0.1  # FP8-sized error, not garbage


def test_decode_sum_packed_one_rank_as_a_list():
    """A sequence of one rank's rows is P = 1: the decode itself."""
    cfg = _cfg()
    rows = ffi_codec.encode_packed(_x((300,), seed=53, nonfinite=False), cfg)
    _same(ffi_codec.decode_sum_packed([rows], cfg, 300), ffi_codec.decode_packed(rows, cfg, 300))


def test_encode_packed_rejects_a_non_float_message():
    with pytest.raises(ValueError, match="dtype=int32"):
        ffi_codec.encode_packed(jnp.ones((256,), jnp.int32), _cfg())
