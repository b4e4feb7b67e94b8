"""Codec kernel backends for the TACO group math (`reference | pallas | triton | ffi | auto`) and the "ffi" wire codec.

Every backend is a pair `(encode_groups, decode_groups)` with the contract of
`taco_jax.codec.backends` (spec §2). Importing this package registers pallas, triton and ffi in
that registry (the codec never imports kernels), the "ffi" wire codec (`ffi_wire`, CPU: packed
wire rows written and read by the C++ kernels) and `resolve`, which
`taco_jax.codec.dispatch.resolve_codec` (the one place "auto" is decided) asks which backend a
name stands for:

  reference  plain jnp (the specification); every platform.
  pallas     fused one-pass Pallas kernels (`pallas_codec`): Triton lowering on GPU (FP8 needs
             sm >= 89), the interpreter on CPU (slow: for tests).
  triton     one-pass Triton kernels through jax-triton (`triton_codec`); GPU only, imported lazily.
pallas and triton read and write float32, bfloat16 and float16 messages as they are and have a
fused decode-sum (`codec.backends.register_native`, registered by their loaders).
  ffi        XLA FFI custom calls (`ffi_codec`): C++ on CPU (AVX2 when the CPU has it), CUDA on
             GPU; needs the shared library built by `make -C custom_calls` (`... cuda` for GPU).
  auto       the default: CPU: ffi if built, else reference. GPU: the fastest backend present by the
             declared speed table (the hardware table's h200 codec speeds, `gpu_speed_table`; `python -m
             experiments.gpu_check --update-speeds` rewrites it from a lent GPU's measurements):
             ffi (CUDA) if built, else triton when jax-triton is installed, else reference (the
             pallas kernels are the slowest on GPU; docs/results.md "GPU path"). When ffi is not
             built, a one-time warning says so and how to build it.

Conformance rule (tested in tests/test_kernels.py against `reference` on the same inputs):
  For a group whose input is finite:
    * scales s and a agree with the reference to a relative 2^-23 * G (a bound for summing G
      float32 terms in another order: butterflies vs. the reference's matmul, lanes vs. XLA's
      reduction, WHT(x) * a vs. WHT(a * x));
    * codes: at most 1e-3 of them differ, and each differing code is one FP8 step from the
      reference's, or (near zero, where FP8 steps are finer than float32 reordering noise: E5M2
      subnormals) within 2^-23 * G * R of it in value. A code flips only where y/s lies within
      rounding of a code boundary;
    * decoded values agree to 2^-23 * G * max|x_ref| over the group; decoded straight into a
      narrower dtype (bfloat16, float16: a backend's native dtypes), within that plus one ulp of
      the dtype of the reference's value clipped to the dtype's range (the float32 values may
      straddle a rounding boundary); a decode-sum of P ranks within 2^-23 * G * sum of the ranks'
      max|x_ref| (`conformance.assert_decode_conforms`).
  For a group holding NaN or +-Inf: s is NaN (so it decodes to NaN), a is the reference's
  formula applied (NaN or 1e-3); its codes are unspecified.
  Measured agreement of each backend: custom_calls/README.md ("Conformance, measured").

Training-level rule (a backend vs `reference`, same config and seed):
  * on a step's real messages (`train.capture`) the encode conforms as above
    (`conformance.check_messages`);
  * the first step's loss (the same weights, so only the codec differs) agrees within what the
    contract allows: 3.5e-4 relative at gpt2-tiny, twice the largest effect of the contract's
    deviation injected into the reference (`conformance.step_codes`; the derivation and the
    one-ulp chaos that makes 1e-5 host-dependent: tests/test_train.py `FIRST_STEP_RTOL`), and
    the first six steps' to 1e-3 (tested for ffi in tests/test_train.py). From the first
    update on, the runs differ by more than the codec's error: AdamW's first update is
    lr * sign(gradient) in every entry, so each gradient entry near zero whose sign flips with a
    rare one-step code flip moves its weight by 2 * lr (gpt2-tiny, TP=4, float32: 0.48 % of the
    entries, step-2 loss 1.1e-4 relative apart). Later the runs drift apart as training amplifies
    these differences like any other reordering of float sums;
  * so the run-level check is against seed noise: over two or more seeds, the backend's mean
    final validation loss lies within two standard errors of the difference from the reference's
    mean (4 seeds measured for ffi, numbers in docs/results.md).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from pathlib import Path

from taco_jax.codec.backends import (
    GroupBackend,
    default_platform,
    register_backend,
    register_native,
    register_reducer,
    register_resolver,
    register_wire,
)
from taco_jax.codec.config import BACKENDS
from taco_jax.codec.dispatch import resolve_codec
from taco_jax.util.jsonio import read_table

#: Backends whose implementation lives in this package: name -> module.
_MODULES = {"pallas": "pallas_codec", "triton": "triton_codec", "ffi": "ffi_codec"}
#: The declared GPU speed of each backend: the hardware table's `[GPU_SPEEDS_KEY.codec]` (its
#: `backend`) and `[GPU_SPEEDS_KEY.codec.backends.NAME]` (read as data; the one place GPU numbers live).
GPU_SPEEDS = Path(__file__).parents[1] / "perf" / "hardware.toml"
GPU_SPEEDS_KEY = "h200"


@functools.cache
def gpu_speed_table() -> dict[str, dict]:
    """{backend: {"encode_GBps", "decode_GBps", "measured", "source"}} from `GPU_SPEEDS`: encode /
    decode throughput on a GPU, GB/s (1e9 B/s) of the uncompressed message; "measured" False marks a
    bound (status "bound", e.g. from the AOT SASS counts of `experiments/triton_aot.py`), which
    `gpu_rank` counts at `UNMEASURED_FRACTION` of its value. Raises ValueError naming a malformed entry."""
    codec = read_table(GPU_SPEEDS, "hardware file")[GPU_SPEEDS_KEY]["codec"]
    rows = {codec["backend"]: codec, **codec.get("backends", {})}
    table = {name: {"encode_GBps": row.get("encode_GBps"), "decode_GBps": row.get("decode_GBps"),
                    "measured": row.get("status") == "measured", "source": row.get("source")}
             for name, row in rows.items()}
    for name, row in table.items():
        ok = all(isinstance(row.get(k), (int, float)) and row[k] > 0 for k in ("encode_GBps", "decode_GBps"))
        if name not in BACKENDS or not ok:
            raise ValueError(f"{GPU_SPEEDS}: bad entry {name!r}: {row!r}")
    return table


#: Share of an unmeasured (bound) speed that `gpu_rank` assumes is achieved: what the measured CUDA
#: FFI encoder reaches of the same HBM bound on an H200 (1386 GB/s of f32 message vs 4.8 TB/s /
#: (1 + 1.0625 / 4) = 3.8 TB/s), so a bound never outranks that measured kernel on its own.
UNMEASURED_FRACTION = 0.36


def gpu_rank(name: str) -> float:
    """Seconds per GB of one encode plus one decode of backend `name` by `gpu_speed_table` (lower is
    faster; an undeclared backend ranks last: inf)."""
    row = gpu_speed_table().get(name)
    if row is None:
        return float("inf")
    f = 1.0 if row["measured"] else UNMEASURED_FRACTION
    return 1.0 / (f * row["encode_GBps"]) + 1.0 / (f * row["decode_GBps"])


def _unavailable(name: str, platform: str) -> str | None:
    """None if backend `name` can run on `platform`, else why not (with a fix, if there is one)."""
    if name in ("reference", "auto"):
        return None
    if name == "pallas":
        if platform in ("cpu", "cuda"):
            return None
        return f"pallas kernels are written for CPU (interpreter) and CUDA (Triton), not {platform}"
    if name == "triton":
        if platform != "cuda":
            return "triton kernels run only on a CUDA GPU (jax-triton has no CPU path)"
        for mod in ("triton", "jax_triton"):
            if importlib.util.find_spec(mod) is None:
                return f"module {mod!r} is not installed (pip install 'taco_jax[gpu]')"
        return None
    if name == "ffi":
        from taco_jax.kernels import ffi_codec  # noqa: PLC0415

        return ffi_codec.unavailable_reason(platform)
    return f"unknown backend {name!r}; choose one of {BACKENDS}"


def available_backends(platform: str | None = None) -> tuple[str, ...]:
    """Backends that can run on `platform` (default: jax's default platform), `auto` included."""
    platform = platform or default_platform()
    return tuple(b for b in BACKENDS if _unavailable(b, platform) is None)


def resolve(name: str, platform: str | None = None, *, n_devices: int = 1) -> str:
    """The concrete backend `name` stands for on `platform` (`auto` -> the fastest available).

    Args:
      name: one of `BACKENDS`.
      platform: "cpu", "cuda", ... (default: jax's default platform).
      n_devices: devices of the program the backend will run in. On CPU, pallas runs the Pallas
        TPU-semantics interpreter, whose per-call host callbacks stall a multi-device program, so
        it is refused for n_devices > 1 (it is for the kernel tests).

    Raises:
      ValueError: if `name` is unknown, not available, or pallas in a multi-device CPU program;
        listing the available backends or the ones to use instead.
    """
    platform = platform or default_platform()
    if name not in BACKENDS:
        raise ValueError(f"unknown codec backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        if platform in ("cuda", "rocm"):  # the declared speed table
            order = sorted((b for b in BACKENDS if b != "auto"), key=gpu_rank)
        else:
            order = ("ffi", "reference")
        got = next(b for b in order if _unavailable(b, platform) is None)
        if got != "ffi":
            _warn_auto_fallback(platform, got, _unavailable("ffi", platform))
        return got
    reason = _unavailable(name, platform)
    if reason is not None:
        raise ValueError(
            f"codec backend {name!r} is not available on {platform}: {reason}. "
            f"Available: {available_backends(platform)}"
        )
    if name == "pallas" and platform == "cpu" and n_devices > 1:
        raise ValueError(f"backend='pallas' runs the Pallas interpreter on CPU, which stalls in a {n_devices}-device "
                         "program; use backend 'ffi', 'auto' or 'reference'")
    if name == "pallas" and platform == "cpu":
        _warn_pallas_interpret()
    return name


@functools.cache
def _warn_auto_fallback(platform: str, got: str, reason: str):
    warnings.warn(
        f"codec backend 'auto' on {platform}: the FFI kernels are not available ({reason}); using "
        f"{got!r}, which is slower. Build them with `make -C custom_calls` (CPU) or `make -C "
        "custom_calls cuda` (GPU), or pass backend 'reference' to silence this",
        stacklevel=4,
    )


@functools.cache
def _warn_pallas_interpret():
    warnings.warn(
        "codec backend 'pallas' on CPU runs the Pallas interpreter: correct but far slower than "
        "'reference' or 'ffi' (meant for tests); use --backend ffi or auto for CPU training",
        stacklevel=3,
    )


def _loader(name: str):
    def load() -> GroupBackend:
        resolve(name)  # a clear ValueError (or the interpreter warning) if it cannot run well here
        mod = importlib.import_module(f"taco_jax.kernels.{_MODULES[name]}")
        if hasattr(mod, "reduce_groups"):
            register_reducer(name, mod.reduce_groups)
        register_native(name, tuple(getattr(mod, "NATIVE_DTYPES", ())), getattr(mod, "decode_sum_groups", None))
        return GroupBackend(mod.encode_groups, mod.decode_groups)

    return load


for _name in _MODULES:
    register_backend(_name, _loader(_name))
register_resolver(resolve)
register_wire("ffi", lambda: importlib.import_module("taco_jax.kernels.ffi_wire").FFI_WIRE, platforms=("cpu",))

__all__ = ["available_backends", "gpu_rank", "gpu_speed_table", "resolve", "resolve_codec"]
