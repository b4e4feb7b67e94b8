"""The Triton kernels of `taco_jax.kernels.triton_codec` conform to `reference` (rule in
`taco_jax.kernels`), run on CPU by Triton's interpreter (`TRITON_INTERPRET=1`) with torch CPU tensors.

jax-triton has no CPU path, so the `@triton.jit` functions are launched directly (no jax-triton),
with the same constexpr arguments `encode_groups` / `decode_groups` / `decode_sum_groups` pass
(`encode_meta`, `decode_meta`), on float32, bfloat16 and float16 messages (read and written in
their own dtype). Needs the `gpu-sim` extra (`pip install -e '.[gpu-sim]'`: CPU torch + triton);
skipped with the reason when either is missing. `make test` installs the extra and runs this file.

Two conversions of the interpreter are replaced. Its FP32 -> FP8 downcast
(`triton.runtime.interpreter._convert_float`) is not round-to-nearest-even (no carry from the
mantissa into the exponent, ties not to even: -126.54 -> -64 instead of -128 in E4M3; likewise in
E5M2) and does not saturate, unlike the GPU's `cvt.rn.satfinite` (which the encoder relies on to
clamp to +-R when R is the format's largest value); its FP32 -> BF16 downcast truncates (the
GPU's `cvt.rn.bf16.f32` rounds to nearest even). The test swaps in exact ones (ml_dtypes, RNE;
saturating for FP8, as `cvt.rn.satfinite`) for FP32 -> float8e4nv / float8e5 / bfloat16; every
other conversion (FP8 -> FP32 in decode, BF16 -> FP32 in encode, FP32 <-> FP16 through numpy) is
the interpreter's own, the FP8 one checked here against ml_dtypes on all finite codes.
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
from taco_jax.kernels import triton_codec  # noqa: E402
from taco_jax.kernels.conformance import assert_conforms, assert_decode_conforms, make_groups  # noqa: E402

pytestmark = pytest.mark.extras

_FP8 = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}
_EXACT = {**_FP8, tl.bfloat16: ml_dtypes.bfloat16}
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def exact_convert_float(stock):
    """`_convert_float` with FP32 -> FP8 (E4M3 / E5M2) and FP32 -> BF16 done exactly (RNE) by
    ml_dtypes; else `stock`."""

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in _EXACT:
            if rounding_mode not in (interpreter._ir.ROUNDING_MODE.RTNE, None if output_dtype == tl.bfloat16 else 0):
                raise ValueError(f"exact downcast implements RTNE only, got {rounding_mode=}")
            bits = np.uint8 if output_dtype in _FP8 else np.uint16
            data = np.asarray(data, np.float32)
            if output_dtype in _FP8:  # cvt.rn.satfinite: out-of-range values saturate (NaN stays NaN)
                big = float(ml_dtypes.finfo(_FP8[output_dtype]).max)
                data = np.clip(data, -big, big)
            with np.errstate(invalid="ignore", over="ignore"):
                return data.astype(_EXACT[output_dtype]).view(bits)
        return stock(data, input_dtype, output_dtype, rounding_mode)

    return convert


@pytest.fixture(scope="module")
def kernels():
    """(encode, decode, decode_sum) kernels built under TRITON_INTERPRET=1, with the exact downcasts."""
    mp = pytest.MonkeyPatch()
    mp.setattr(interpreter, "_convert_float", exact_convert_float(interpreter._convert_float))
    triton_codec._kernels.cache_clear()
    try:
        ks = triton_codec._kernels()
        assert isinstance(ks[0], interpreter.InterpretedFunction), "TRITON_INTERPRET=1 did not take effect"
        yield ks
    finally:
        triton_codec._kernels.cache_clear()  # later users build real (GPU) kernels
        sys.modules.pop("taco_jax.kernels._triton_kernels", None)
        mp.undo()


def _torch(a: np.ndarray, dtype: str):
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _numpy(t, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _codes(codes: np.ndarray, fmt: str):
    return torch.from_numpy(np.ascontiguousarray(codes).view(np.uint8)).view(_TORCH_FP8[fmt])


def run_encode(enc, x2: np.ndarray, cfg: CodecConfig, n_groups: int, last_count: int):
    """x2 [n, G] in its own dtype (float32 / bfloat16 / float16) -> (codes, s, a) numpy."""
    n, g = x2.shape
    codes = torch.empty((n, g), dtype=_TORCH_FP8[cfg.fmt])
    s, a = torch.empty(n), torch.empty(n)
    grid = (triton_codec.cdiv(n, triton_codec.block_groups(g)),)
    enc[grid](_torch(x2, x2.dtype.name), codes, s, a, **triton_codec.encode_meta(cfg, n, n_groups, last_count))
    return codes.view(torch.uint8).numpy().view(cfg.code_dtype), s.numpy(), a.numpy()


def run_decode(dec, codes: np.ndarray, s: np.ndarray, a: np.ndarray | None, fmt: str, dtype: str = "float32"):
    """codes [n, G] (or [P, n, G] with `dec` the decode_sum kernel), s, a -> decoded [n, G] in `dtype`."""
    *lead, n, g = codes.shape
    out = torch.empty((n, g), dtype=_TORCH[dtype])
    s_t = torch.from_numpy(np.ascontiguousarray(s, np.float32))
    a_t = s_t if a is None else torch.from_numpy(np.ascontiguousarray(a, np.float32))
    grid = (triton_codec.cdiv(n, triton_codec.block_groups(g)),)
    meta = triton_codec.decode_meta(n, g, has_a=a is not None, dtype=dtype, p=lead[0] if lead else None)
    dec[grid](_codes(codes, fmt), s_t, a_t, out, **meta)
    return _numpy(out, dtype)


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


def _reference_encode(x: np.ndarray, cfg: CodecConfig, last_count: int):
    """reference.encode_groups of x [..., n_groups, G] (any float dtype, read as float32), flattened to [n, G] / [n]."""
    got = reference.encode_groups(jnp.asarray(x.astype(np.float32)), cfg, last_count=last_count)
    g = x.shape[-1]
    return np.asarray(got[0]).reshape(-1, g), np.asarray(got[1]).reshape(-1), np.asarray(got[2]).reshape(-1)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the 1e30 group's x * x, as on GPU
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the NaN group's max, as on GPU
@pytest.mark.parametrize(("batch", "n_groups"), [(2, 24), (1, 21)], ids=["48groups", "21groups"])
@pytest.mark.parametrize("g", [32, 128, 512])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_triton_kernels_conform_to_reference(kernels, fmt, g, batch, n_groups):
    """float32 messages: encode conforms (partial last group, NaN / Inf groups, zero / huge / tiny
    groups included); decoding the same codes in the dual (s, a) and folded (s / a) layouts conforms."""
    enc, dec, _ = kernels
    cfg = CodecConfig(fmt=fmt, group_size=g)
    x, last_count = make_groups(g, n_groups=n_groups, batch=batch, seed=g)
    x2 = x.reshape(-1, g)
    got = run_encode(enc, x2, cfg, n_groups, last_count)
    want = _reference_encode(x, cfg, last_count)
    assert np.isnan(want[1]).sum() == 3, "the data must hold one NaN and two Inf groups"
    assert last_count < g, "the last group must be partial"
    assert_conforms(got, want, g, r=cfg.target_range)
    codes, s, a = got
    assert_decode_conforms(run_decode(dec, codes, s, a, fmt), reference.decode_groups(codes, s, a), g)
    s_fold = s / a
    assert_decode_conforms(run_decode(dec, codes, s_fold, None, fmt), reference.decode_groups(codes, s_fold, None), g)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Inf - Inf in the Inf groups
@pytest.mark.parametrize("g", [64, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_kernels_conform_on_native_dtypes(kernels, dtype, g):
    """bfloat16 / float16 messages read as they are (encode conforms to `reference` on the same values
    in float32: float16 turns the 1e30 group into Inf and the 1e-30 one into 0); decode written
    straight in the message dtype conforms (clipped to its range, within one ulp of the reference's
    rounded value); decode-sum of 3 ranks in float32 and in the message dtype conforms to the
    rank-order float32 sum of the reference's decodes, and to float32 decode + sum bit for bit."""
    enc, dec, dec_sum = kernels
    cfg = CodecConfig(group_size=g)
    n_groups, p = 20, 3
    xs = []
    for r in range(p):
        x, last_count = make_groups(g, n_groups=n_groups, batch=1, seed=g + r)
        xs.append(x.astype(_NP[dtype]))
    encs = []
    for x in xs:
        got = run_encode(enc, x.reshape(-1, g), cfg, n_groups, last_count)
        want = _reference_encode(x, cfg, last_count)
        assert np.isnan(want[1]).sum() == (3 if dtype == "bfloat16" else 4)  # float16: 1e30 -> Inf
        assert_conforms(got, want, g, r=cfg.target_range)
        encs.append(got)
    codes, s, a = (np.stack(t) for t in zip(*encs))
    want = [np.asarray(reference.decode_groups(codes[r], s[r], a[r])) for r in range(p)]
    assert_decode_conforms(run_decode(dec, codes[0], s[0], a[0], cfg.fmt, dtype), want[0], g, dtype=dtype)
    total = want[0] + want[1] + want[2]  # rank order, float32
    ref_max = sum(np.max(np.abs(w), axis=-1, keepdims=True) for w in want)
    for out in ("float32", dtype):
        got = run_decode(dec_sum, codes, s, a, cfg.fmt, out)
        assert_decode_conforms(got, total, g, dtype=out, ref_max=ref_max)
    parts = [run_decode(dec, codes[r], s[r], a[r], cfg.fmt) for r in range(p)]
    np.testing.assert_array_equal(run_decode(dec_sum, codes, s, a, cfg.fmt), (parts[0] + parts[1]) + parts[2])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_encode_clamps_to_a_target_range_below_the_format_max(kernels):
    """R = 240 < 448: the encoder clamps to +-R itself (the conversion saturates only at 448)."""
    enc = kernels[0]
    cfg = CodecConfig(group_size=32, target_range=240.0)
    x, last_count = make_groups(32, n_groups=24, batch=1, seed=3)
    got = run_encode(enc, x.reshape(-1, 32), cfg, 24, last_count)
    assert triton_codec.encode_meta(cfg, 24, 24, last_count)["CLAMP"] is True
    assert_conforms(got, _reference_encode(x, cfg, last_count), 32, r=240.0)
    finite = np.isfinite(got[1])
    assert np.abs(got[0][finite].astype(np.float32)).max() == 240.0


def test_decode_clips_to_float16_range_and_keeps_nan(kernels):
    """A decoded value beyond float16's range is written as +-65504 (not Inf); a NaN group stays NaN."""
    _, dec, _ = kernels
    g = 32
    codes = np.full((2, g), 1.0, ml_dtypes.float8_e4m3fn)
    s = np.array([1e6, np.nan], np.float32)  # y = 1e6 per element -> x = 1e6 * sqrt(G) at index 0
    got = run_decode(dec, codes, s, None, "e4m3", "float16")
    assert got[0, 0] == np.float16(65504) and np.all(np.isfinite(got[0]))
    assert np.all(np.isnan(got[1]))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's float16 cast
def test_decode_sum_rounds_the_sum_without_clipping(kernels):
    """A decode-sum whose float32 sum overflows float16 writes +-Inf there, as the exact sum and the
    reference's decode-sum do (not 65504: that is for a single decode); the rest stays finite."""
    _, _, dec_sum = kernels
    g, p = 32, 3
    codes = np.full((p, 2, g), 1.0, ml_dtypes.float8_e4m3fn)
    codes[:, 1] = -codes[:, 1]
    s = np.full((p, 2), 5000.0, np.float32)  # each rank: +-5000 * sqrt(G) = 28284 at index 0, 0 elsewhere
    got = run_decode(dec_sum, codes, s, None, "e4m3", "float16")
    assert np.isposinf(got[0, 0]) and np.isneginf(got[1, 0]) and np.all(got[:, 1:] == 0)


def test_exact_downcast_rounds_ties_to_even_with_carry_and_saturates():
    """The swapped-in conversion: the case the stock interpreter gets wrong, ties to even, saturation."""
    conv = exact_convert_float(interpreter._convert_float)
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    x = np.array([-126.54, 124.0, 13.5, 14.5], np.float32)  # ties: 124 in (120, 128), 13.5, 14.5 -> even
    got = conv(x, tl.float32, tl.float8e4nv, rtne).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, [-128.0, 128.0, 14.0, 14.0])
    sat = np.array([1e6, -500.0, np.nan], np.float32)  # beyond 448 -> +-448, NaN stays NaN
    got = conv(sat, tl.float32, tl.float8e4nv, rtne).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, [448.0, -448.0, np.nan])
    b = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], np.float32)  # ties -> even, then above the tie
    got = conv(b, tl.float32, tl.bfloat16, None).view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, [1.0, 1 + 4 * 2**-8, 1 + 2**-7])
    with pytest.raises(ValueError, match="RTNE only"):
        conv(x, tl.float32, tl.float8e5, interpreter._ir.ROUNDING_MODE.RTZ)


def test_encode_meta_matches_config():
    cfg = CodecConfig(fmt="e5m2", group_size=128)
    meta = triton_codec.encode_meta(cfg, n=40, n_groups=20, last_count=7)
    assert meta["E4M3"] is False and meta["LAST_COUNT"] == 7 and meta["N_GROUPS"] == 20
    assert meta["SQRT_G"] == float(np.float32(math.sqrt(128))) and 2 ** meta["LOG_G"] == meta["G"]
    assert meta["BLOCK"] * 128 == triton_codec.ELEMENTS
    dmeta = triton_codec.decode_meta(40, 128, has_a=False, dtype="float16", p=4)
    assert dmeta["CLIP"] == 0 and dmeta["P"] == 4  # a decode-sum is not clipped: +-Inf where it overflows
    assert triton_codec.decode_meta(40, 128, has_a=False, dtype="float16")["CLIP"] == 65504.0
    assert triton_codec.decode_meta(40, 128, has_a=True)["CLIP"] == 0
