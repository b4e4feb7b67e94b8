"""The Triton kernels of `taco_jax.kernels.triton_codec` conform to `reference` (rule in
`taco_jax.kernels`), run on CPU by Triton's interpreter (`TRITON_INTERPRET=1`) with torch CPU tensors.

jax-triton has no CPU path, so the `@triton.jit` functions are launched directly (no jax-triton),
with the same constexpr arguments `encode_groups` / `decode_groups` pass (`encode_meta`,
`decode_meta`). Needs the `gpu-sim` extra (`pip install -e '.[gpu-sim]'`: CPU torch + triton);
skipped with the reason when either is missing. `make test` installs the extra and runs this file.

One conversion of the interpreter is replaced: its FP32 -> FP8 downcast
(`triton.runtime.interpreter._convert_float`) is not round-to-nearest-even (no carry from the
mantissa into the exponent, ties not to even: -126.54 -> -64 instead of -128 in E4M3; likewise in
E5M2), unlike the GPU's `cvt.rn.satfinite`. The test swaps in an exact one (ml_dtypes, RNE) for
FP32 -> float8e4nv / float8e5; every other conversion (FP8 -> FP32 in decode included) is the
interpreter's own, checked here against ml_dtypes on all finite codes.
"""

import math
import os
import sys

import ml_dtypes
import numpy as np
import pytest

# Triton's own library functions (tl.sum, ...) are @triton.jit'd when triton is imported: the
# interpreter must be on by then (setting it later leaves them uncallable from interpreted kernels).
_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"
torch = pytest.importorskip("torch", reason="gpu-sim extra not installed (pip install -e '.[gpu-sim]')")
triton = pytest.importorskip("triton", reason="gpu-sim extra not installed (pip install -e '.[gpu-sim]')")
if _PREIMPORTED:
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: run this file in its own process")

import jax.numpy as jnp  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from taco_jax.codec import reference  # noqa: E402
from taco_jax.codec.config import CodecConfig  # noqa: E402
from taco_jax.codec.hadamard import hadamard  # noqa: E402
from taco_jax.kernels import triton_codec  # noqa: E402
from taco_jax.kernels.conformance import assert_conforms, assert_decode_conforms, make_groups  # noqa: E402

_FP8 = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def exact_convert_float(stock):
    """`_convert_float` with FP32 -> FP8 (E4M3 / E5M2, RNE) done exactly by ml_dtypes; else `stock`."""

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in _FP8:
            if rounding_mode != interpreter._ir.ROUNDING_MODE.RTNE:
                raise ValueError(f"exact FP8 downcast implements RTNE only, got {rounding_mode=}")
            with np.errstate(invalid="ignore", over="ignore"):
                return np.asarray(data, np.float32).astype(_FP8[output_dtype]).view(np.uint8)
        return stock(data, input_dtype, output_dtype, rounding_mode)

    return convert


@pytest.fixture(scope="module")
def kernels():
    """(encode_kernel, decode_kernel) built under TRITON_INTERPRET=1, with the exact FP8 downcast."""
    mp = pytest.MonkeyPatch()
    mp.setattr(interpreter, "_convert_float", exact_convert_float(interpreter._convert_float))
    triton_codec._kernels.cache_clear()
    try:
        enc, dec = triton_codec._kernels()
        assert isinstance(enc, interpreter.InterpretedFunction), "TRITON_INTERPRET=1 did not take effect"
        yield enc, dec
    finally:
        triton_codec._kernels.cache_clear()  # later users build real (GPU) kernels
        mp.undo()


def run_encode(enc, x2: np.ndarray, cfg: CodecConfig, n_groups: int, last_count: int):
    n, g = x2.shape
    codes = torch.empty((n, g), dtype=_TORCH_FP8[cfg.fmt])
    s, a = torch.empty(n), torch.empty(n)
    h = torch.from_numpy(np.asarray(hadamard(g), np.float32))
    grid = (triton_codec.pl_cdiv(n, triton_codec._BLOCK),)
    enc[grid](torch.from_numpy(x2), h, codes, s, a, **triton_codec.encode_meta(cfg, n, n_groups, last_count))
    return codes.view(torch.uint8).numpy().view(cfg.code_dtype), s.numpy(), a.numpy()


def run_decode(dec, codes: np.ndarray, s: np.ndarray, a: np.ndarray | None, fmt: str):
    n, g = codes.shape
    out = torch.empty((n, g))
    c = torch.from_numpy(codes.view(np.uint8).copy()).view(_TORCH_FP8[fmt])
    s_t = torch.from_numpy(np.ascontiguousarray(s, np.float32))
    a_t = s_t if a is None else torch.from_numpy(np.ascontiguousarray(a, np.float32))
    h = torch.from_numpy(np.asarray(hadamard(g), np.float32))
    grid = (triton_codec.pl_cdiv(n, triton_codec._BLOCK),)
    dec[grid](c, s_t, a_t, h, out, **triton_codec.decode_meta(n, g, has_a=a is not None))
    return out.numpy()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_interpreter_fp8_to_f32_matches_ml_dtypes_on_all_codes(fmt):
    """The interpreter's own FP8 -> FP32 upcast (used by decode, not replaced) is exact on finite codes.

    (It is not on E5M2 +-Inf and NaN codes, which the codec never decodes to anything but NaN: the
    quantizer clamps to +-R, finite, and NaN codes occur only in groups whose s is NaN.)"""
    ml = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    codes = np.arange(256, dtype=np.uint8)
    src = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}[fmt]
    got = interpreter._convert_float(codes, src, tl.float32, None).view(np.float32)
    want = codes.view(ml).astype(np.float32)
    finite = np.isfinite(want)
    assert finite.sum() >= 248
    np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the 1e30 group's x * x, as on GPU
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the NaN group's max, as on GPU
@pytest.mark.parametrize(("batch", "n_groups"), [(2, 24), (1, 21)], ids=["48groups", "21groups_partial_program"])
@pytest.mark.parametrize("g", [32, 128, 512])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_triton_kernels_conform_to_reference(kernels, fmt, g, batch, n_groups):
    """Encode conforms (partial last group, NaN / Inf groups, zero / huge / tiny groups included);
    decoding the same codes in the dual (s, a) and folded (s / a) layouts conforms."""
    enc, dec = kernels
    cfg = CodecConfig(fmt=fmt, group_size=g)
    x, last_count = make_groups(g, n_groups=n_groups, batch=batch, seed=g)
    x2 = x.reshape(-1, g)
    got = run_encode(enc, x2, cfg, n_groups, last_count)
    want = reference.encode_groups(jnp.asarray(x), cfg, last_count=last_count)
    want = (np.asarray(want[0]).reshape(x2.shape), np.asarray(want[1]).reshape(-1), np.asarray(want[2]).reshape(-1))
    assert np.isnan(want[1]).sum() == 3, "the data must hold one NaN and two Inf groups"
    assert last_count < g, "the last group must be partial"
    assert_conforms(got, want, g, r=cfg.target_range)
    codes, s, a = got
    assert_decode_conforms(run_decode(dec, codes, s, a, fmt), reference.decode_groups(codes, s, a), g)
    s_fold = s / a
    assert_decode_conforms(run_decode(dec, codes, s_fold, None, fmt), reference.decode_groups(codes, s_fold, None), g)


def test_exact_downcast_rounds_ties_to_even_with_carry():
    """The swapped-in conversion: the case the stock interpreter gets wrong, and ties to even."""
    conv = exact_convert_float(interpreter._convert_float)
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    x = np.array([-126.54, 124.0, 13.5, 14.5], np.float32)  # ties: 124 in (120, 128), 13.5, 14.5 -> even
    got = conv(x, tl.float32, tl.float8e4nv, rtne).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, [-128.0, 128.0, 14.0, 14.0])
    with pytest.raises(ValueError, match="RTNE only"):
        conv(x, tl.float32, tl.float8e5, interpreter._ir.ROUNDING_MODE.RTZ)


def test_encode_meta_matches_config():
    cfg = CodecConfig(fmt="e5m2", group_size=128)
    meta = triton_codec.encode_meta(cfg, n=40, n_groups=20, last_count=7)
    assert meta["E4M3"] is False and meta["LAST_COUNT"] == 7 and meta["N_GROUPS"] == 20
    assert meta["SQRT_G"] == float(np.float32(math.sqrt(128))) and meta["G"] % meta["CHUNK"] == 0
