"""Adding a codec kind: one registry entry (`taco_jax.codec.kinds`) is all the package needs.

A kind defined here, MX-style (FP8 codes in blocks of 32 with a power-of-two scale stored as
bfloat16, not float32), is registered and run through every piece that serves a kind: encode /
decode, the wire layout and its bytes, the three compressed collectives, `--comm` / `--site` /
`--dp-comm` parsing, the compiled program's wire bytes and the cost model, calibration and its
plot. Each piece is checked on its own; the test fails naming every piece that does not take the
new kind.
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taco_jax import collectives as C
from taco_jax.codec import CodecConfig, CodecKind, codec_kinds, decode, encode, get_kind, kinds, register_kind

NAME = "mx_test"
G = 32


def _mx_encode(xg, cfg, *, last_count):
    """Per block: s = 2^ceil(log2(absmax / F)) (a power of two, so bfloat16 holds it exactly), codes
    = FP8(x / s); a block holding NaN/±Inf gets a NaN scale."""
    del last_count
    amax = jnp.max(jnp.abs(xg), axis=-1)
    s = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, np.float32(2.0**-100)) / np.float32(cfg.fmax))))
    s = jnp.where(jnp.all(jnp.isfinite(xg), axis=-1), s, np.float32(np.nan))
    codes = jnp.clip(xg / s[..., None], -cfg.fmax, cfg.fmax).astype(cfg.code_dtype)
    return codes, s.astype(jnp.bfloat16), None


def _mx_decode(codes, scale, prescale, cfg):
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


MX = CodecKind(NAME, 8, None, _mx_encode, _mx_decode, scale_dtype=ml_dtypes.bfloat16, group_sizes=(G,),
               color="tab:cyan", summary="MX-style FP8 blocks of 32, power-of-two bfloat16 scale")
EPS = 2.0**-4 + 1e-3  # E4M3 rounding (3 mantissa bits) with absmax / s in (F/2, F]: relative L2 per block
LIMIT = 1 + 2 / G  # wire bytes per element: one FP8 code + one 2-byte scale per block of 32


@pytest.fixture(scope="module")
def kind():
    """MX registered for this module only (the registry is restored afterwards)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kinds, "_KINDS", dict(kinds._KINDS))
        register_kind(MX)
        yield CodecConfig(kind=NAME, group_size=G)


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * np.exp(rng.normal(0, 1, shape[-1:])))


def _smap(mesh, fn):
    spec = P(("data", "tensor"))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))


def _registry(codec):
    assert NAME in codec_kinds() and get_kind(NAME) is MX
    assert codec.code_dtype == jnp.float8_e4m3fn and codec.scale_dtype == ml_dtypes.bfloat16
    assert codec.name == f"{NAME}-e4m3-G{G}" and not codec.transforms
    with pytest.raises(ValueError, match=rf"group_size=128: kind='{NAME}' takes group sizes \(32,\)"):
        CodecConfig(kind=NAME)
    with pytest.raises(ValueError, match=r"hadamard=True applies to kinds"):
        CodecConfig(kind=NAME, group_size=G, hadamard=True)


def _encode_decode(codec):
    x = _x((6, 100), 1)
    enc = encode(x, codec)
    assert enc.codes.dtype == jnp.float8_e4m3fn and enc.codes.shape == (19, G)  # 600 elements, last block padded
    assert enc.scale.dtype == jnp.bfloat16 and enc.prescale is None
    y = decode(enc, codec)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert 0 < np.linalg.norm(y - x) <= EPS * np.linalg.norm(x)
    nan = decode(encode(x.at[0, 0].set(jnp.nan), codec), codec)
    assert np.isnan(nan[0, 0]) and np.all(np.isfinite(np.asarray(nan).reshape(-1)[G:]))  # only that block
    for dtype in (jnp.bfloat16, jnp.float16):
        assert decode(encode(x.astype(dtype), codec), codec).dtype == dtype


def _wire_bytes(codec):
    from taco_jax.codec.wire import pack_rows, unpack_rows

    x = _x((3, 333), 2)  # a partial last block
    enc = encode(x, codec)
    assert enc.nbytes == pytest.approx(codec.wire_bytes_per_element(n=x.size) * x.size)
    assert codec.wire_bytes_per_element() == LIMIT
    back = unpack_rows(pack_rows(enc, 0), codec, x.shape, x.dtype)
    jax.tree.map(np.testing.assert_array_equal, back, enc)
    empty = encode(jnp.zeros((0, 8)), codec)
    assert empty.scale.dtype == jnp.bfloat16 and decode(empty, codec).shape == (0, 8)


def _psum(codec, mesh):
    x = _x((8, 6, 100), 5)
    out = _smap(mesh, lambda v: C.psum(v, "tensor", codec=codec))(x)
    ref = _smap(mesh, lambda v: jax.lax.psum(v, "tensor"))(x)
    sum_norms = sum(np.linalg.norm(p) for p in np.asarray(x)[:4])  # device 0's group: the 4 tensor ranks
    bound = EPS * sum_norms + EPS * (np.linalg.norm(ref[0]) + EPS * sum_norms)  # two quantizations
    assert 0 < np.linalg.norm(out[0] - ref[0]) <= bound


def _all_gather(codec, mesh):
    x = _x((32, 16, 128), 7)
    out = _smap(mesh, lambda v: C.all_gather(v, "tensor", codec=codec, axis=1, tiled=True))(x)
    ref = _smap(mesh, lambda v: jax.lax.all_gather(v, "tensor", axis=1, tiled=True))(x)
    assert 0 < np.linalg.norm(out - ref) <= EPS * np.linalg.norm(ref)


def _psum_scatter(codec, mesh):
    x = _x((32, 16, 128), 8)
    out = _smap(mesh, lambda v: C.psum_scatter(v, "tensor", codec=codec, scatter_dimension=1))(x)
    ref = _smap(mesh, lambda v: jax.lax.psum_scatter(v, "tensor", scatter_dimension=1, tiled=True))(x)
    sum_norms = np.sum(np.linalg.norm(np.asarray(x).reshape(8, -1), axis=1))
    assert 0 < np.linalg.norm(out - ref) <= EPS * sum_norms


def _flags(codec):
    from taco_jax.train.config import TrainConfig

    cfg = TrainConfig.from_flags(comm=NAME, group_size=G, dp_comm=NAME, site=(f"pp_send:kind={NAME},group_size={G}",
                                                                           f"ar_bwd:kind={NAME},fmt=e5m2"))
    pol = cfg.communication.policy
    assert pol.ar_fwd == pol.dp_grads == pol.pp_send == codec
    assert pol.ar_bwd == CodecConfig(kind=NAME, group_size=G, fmt="e5m2")
    with pytest.raises(ValueError, match=rf"group_size=64: kind='{NAME}' takes group sizes"):
        TrainConfig.from_flags(site=(f"ar_fwd:kind={NAME},group_size=64",))


def _accounting(codec, mesh):
    from taco_jax import perf
    from taco_jax.collectives.hlo import collective_bytes

    x = _x((8, 64, 256), 9)

    def tensor_bytes(c):
        f = _smap(mesh, lambda v: C.psum(v, "tensor", codec=c))
        rows = collective_bytes(f.lower(x).compile().as_text(), mesh)["detail"]
        return sum(r["bytes"] for r in rows if r["axis"] == "tensor")

    fp32_scale = CodecConfig(kind="fp8_group", group_size=G)  # the same codes with a 4-byte scale
    assert tensor_bytes(codec) / tensor_bytes(fp32_scale) == pytest.approx(LIMIT / (1 + 4 / G), rel=1e-3)
    assert perf.wire_ratio(codec, 4) == LIMIT / 4


def _calibration(codec, tmp_path):
    from experiments.fidelity.fidelity import plot
    from taco_jax.collectives.policy import CommPolicy
    from taco_jax.train.calibrate import calibrate, candidates

    mine = [c for c in candidates() if c.kind == NAME]
    assert {(c.fmt, c.group_size, c.group_axis) for c in mine} == {(f, G, a) for f in ("e4m3", "e5m2")
                                                                    for a in ("hidden", "token")}
    caps = tmp_path / "captures"
    caps.mkdir()
    (caps / "meta.json").write_text("{}")
    for step in (1, 2):
        np.savez(caps / f"step{step}.npz", ar_fwd__exit01=np.asarray(_x((4, 16, 64), step)))
    policy = tmp_path / "policy.json"
    report = calibrate(caps, policy, cands=[*mine, CodecConfig(kind="int4", group_size=G)], progress=False)
    assert {row["config"]["kind"] for row in report["table"]} >= {NAME}
    assert CommPolicy.from_json(policy).ar_fwd.kind == NAME  # the best within the budget
    assert json.loads(policy.with_suffix(".report.json").read_text())["candidates"] == len(mine) + 2
    plot([str(policy)], tmp_path / "plot.png")  # the kind drawn in its registry colour
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_overflow_groups_need_fp8_codes_and_a_float32_scale():
    """`CodecKind.overflow` (the two-shot all-reduce's overflow groups: FP8 codes, a float32 scale) is
    refused for a kind whose wire buffers cannot hold them, as MX's bfloat16 scale; MX leaves it off,
    so a partial sum of it that overflows decodes to NaN as a non-finite group."""
    with pytest.raises(ValueError, match="overflow=True needs FP8 codes"):
        CodecKind("mx_bad", 8, None, _mx_encode, _mx_decode, scale_dtype=ml_dtypes.bfloat16, overflow=True)
    with pytest.raises(ValueError, match="overflow=True needs FP8 codes"):
        CodecKind("int_bad", 8, np.int8, _mx_encode, _mx_decode, overflow=True)
    assert not MX.overflow and [k for k in codec_kinds()[1:] if get_kind(k).overflow] == \
        ["fp8_tensor", "fp8_group", "taco"]


def test_a_kind_registered_in_a_test_runs_through_every_piece(kind, mesh, tmp_path):
    pieces = {
        "registry and CodecConfig validation": lambda: _registry(kind),
        "encode / decode": lambda: _encode_decode(kind),
        "wire layout and bytes per element": lambda: _wire_bytes(kind),
        "collective psum (two-shot all-reduce)": lambda: _psum(kind, mesh),
        "collective all_gather": lambda: _all_gather(kind, mesh),
        "collective psum_scatter": lambda: _psum_scatter(kind, mesh),
        "--comm / --dp-comm / --site parsing": lambda: _flags(kind),
        "wire-byte accounting (compiled HLO, cost model)": lambda: _accounting(kind, mesh),
        "calibration and its plot": lambda: _calibration(kind, tmp_path),
    }
    missing = {}
    for name, check in pieces.items():
        try:
            check()
        except Exception as e:  # noqa: BLE001  (every piece is reported, not only the first)
            missing[name] = f"{type(e).__name__}: {str(e)[:300]}"
    assert not missing, "pieces that do not take a new codec kind:\n" + "\n".join(f"  {k}: {v}"
                                                                               for k, v in missing.items())
