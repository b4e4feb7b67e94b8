"""The dispatcher hands a message to a group backend that declares its dtype native as it is: no
float32 convert before encode or after decode, and a fused decode-sum when the backend has one;
other backends get float32 as before. A probe backend (the reference math, recording what it is
given) is registered in place of "reference" for the test and restored after."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax.codec import backends, dispatch, reference, wire
from taco_jax.codec.config import CodecConfig


@contextlib.contextmanager
def probe_backend(native: tuple[str, ...]):
    """"reference" replaced by the reference math taking `native` dtypes as they are; yields the log
    of (function, dtype) calls."""
    log = []

    def enc(xg, cfg, *, last_count):
        log.append(("encode", xg.dtype.name))
        return reference.encode_groups(xg.astype(jnp.float32), cfg, last_count=last_count)

    def dec(codes, s, a, *, dtype=jnp.float32):
        log.append(("decode", jnp.dtype(dtype).name))
        return dispatch.clip_to_dtype(reference.decode_groups(codes, s, a), dtype).astype(dtype)

    def dec_sum(codes, s, a, *, dtype):
        log.append(("decode_sum", jnp.dtype(dtype).name))
        y = reference.decode_groups(codes, s, a)
        return dispatch.clip_to_dtype(wire.sum_fp32(y, jnp.float32), dtype).astype(dtype)

    old = backends._LOADERS["reference"]

    def load():
        backends.register_native("reference", native, dec_sum)
        return backends.GroupBackend(enc, dec)

    backends.register_backend("reference", load)
    try:
        yield log
    finally:
        backends.register_backend("reference", old)


CFG = CodecConfig(backend="reference", wire="generic", group_size=32)


def _x(dtype):
    return jnp.asarray(np.random.default_rng(0).standard_normal((4, 40)), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_native_backend_gets_the_message_dtype_and_no_convert_is_compiled(dtype):
    with probe_backend(("bfloat16", "float16")) as log:
        x = _x(dtype)
        f = jax.jit(lambda x: dispatch.decode(dispatch.encode(x, CFG), CFG))
        y = f(x)
        assert y.dtype == x.dtype and ("encode", dtype) in log and ("decode", dtype) in log
        hlo = f.lower(x).as_text()
    want = dispatch.clip_to_dtype(reference.decode_groups(*reference.encode_groups(
        x.astype(jnp.float32).reshape(5, 32), CFG, last_count=32)), dtype).astype(dtype)
    np.testing.assert_array_equal(np.asarray(y).reshape(-1), np.asarray(want).reshape(-1))
    # the probe converts its [5, 32] groups inside itself; the dispatcher converts none of the
    # message's flat rows [160] (what it did for a backend without native dtypes)
    assert re.findall(r"convert.*tensor<5x32x", hlo) and not re.findall(r"convert.*tensor<160x", hlo)


def test_other_dtypes_and_backends_without_native_dtypes_get_float32():
    with probe_backend(("bfloat16",)) as log:
        dispatch.decode(dispatch.encode(_x("float16"), CFG), CFG)
    assert log == [("encode", "float32"), ("decode", "float32")]
    with probe_backend(()) as log:
        dispatch.decode(dispatch.encode(_x("bfloat16"), CFG), CFG)
    assert log == [("encode", "float32"), ("decode", "float32")]


def test_decode_sum_runs_the_fused_kernel_and_matches_decode_then_sum():
    x = jnp.stack([_x("bfloat16"), 2 * _x("bfloat16"), -_x("bfloat16")])
    enc = dispatch.encode(x, CFG, batch_dims=1)
    want = wire.sum_fp32(dispatch.decode(enc, CFG, jnp.float32), jnp.bfloat16)
    with probe_backend(("bfloat16",)) as log:
        got = dispatch.decode_sum(enc, CFG)
        rows = wire.pack_rows(enc, 1)
        got_rows = wire.decode_sum_rows(rows, CFG, (4, 40), jnp.bfloat16)
    assert log == [("decode_sum", "bfloat16")] * 2
    assert got.shape == (4, 40) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_rows), np.asarray(want))


def test_auto_on_gpu_ranks_the_backends_present_by_the_declared_speed_table(monkeypatch):
    """`auto` on CUDA takes the fastest backend present by the hardware table's h200 codec speeds; a bound
    entry counts at UNMEASURED_FRACTION of its value."""
    import warnings

    from taco_jax import kernels

    table = kernels.gpu_speed_table()
    assert {"ffi", "reference", "pallas", "triton"} <= set(table)
    order = sorted(table, key=kernels.gpu_rank)
    assert order.index("reference") > min(order.index("ffi"), order.index("triton"))  # a kernel before jnp
    present = {"reference", "pallas"}
    monkeypatch.setattr(kernels, "_unavailable", lambda b, p: None if b in present or b == "auto" else "absent")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for extra in ("triton", "ffi"):
            want = min(present | {extra}, key=kernels.gpu_rank)
            present.add(extra)
            assert kernels.resolve("auto", "cuda") == want
    assert kernels.resolve("auto", "cuda") == order[0]
