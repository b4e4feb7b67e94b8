"""Codec kernel backends for the TACO group math (`reference | pallas | triton | ffi | auto`) and the "ffi" wire codec.

Importing this package registers pallas, triton and ffi (pairs `(encode_groups, decode_groups)`,
contract in `taco_jax.codec.backends`), the "ffi" wire codec (`ffi_wire`, CPU) and `resolve`, which
`codec.dispatch.resolve_codec` asks what a backend name stands for:

  reference  plain jnp (the specification); every platform.
  pallas     one-pass Pallas kernels (`pallas_codec`): Triton lowering on GPU (FP8 needs sm >= 89),
             the interpreter on CPU (slow: for tests).
  triton     one-pass Triton kernels through jax-triton (`triton_codec`); GPU only.
  ffi        XLA FFI custom calls (`ffi_codec`): C++ on CPU, CUDA on GPU; needs `make -C custom_calls`
             (`... cuda` for GPU).
  auto       CPU: ffi if built, else reference (warning once). GPU: the fastest present by the
             declared speed table (`gpu_speed_table`: the hardware table's h200 codec speeds).
pallas and triton read and write float32, bfloat16 and float16 as they are and have a fused decode-sum.

Conformance rule (tests/test_kernels.py, against `reference` on the same inputs), finite groups:
  * s and a agree to a relative 2^-23 * G (summing G float32 terms in another order);
  * at most 1e-3 of the codes differ, each by one FP8 step or (E5M2 subnormals) by at most
    2^-23 * G * R in value: a code flips only where y/s lies within rounding of a code boundary;
  * decoded values agree to 2^-23 * G * max|x_ref| over the group; decoded into a native narrower
    dtype, within that plus one ulp of the dtype; a decode-sum of P ranks within 2^-23 * G * the sum
    of the ranks' max|x_ref| (`conformance.assert_decode_conforms`).
  A group holding NaN/±Inf: s is NaN, a the reference's formula, codes unspecified.
Training-level rule (a backend vs `reference`, same config and seed): captured messages conform
(`conformance.check_messages`); the first step's loss agrees within `FIRST_STEP_RTOL` (tests/test_train.py, from
`conformance.step_codes`), the first six steps' to 1e-3; later the runs drift apart (AdamW's first update is lr *
sign(gradient)), so over seeds the mean final validation loss lies within two standard errors of the reference's
(docs/results.md)."""

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
    """{backend: {"encode_GBps", "decode_GBps", "measured", "source"}} from `GPU_SPEEDS`: GB/s (1e9 B/s)
    of uncompressed message; "measured" False marks a bound (status "bound"), counted at
    `UNMEASURED_FRACTION`. Raises ValueError naming a malformed entry."""
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


#: Share of an unmeasured (bound) speed that `gpu_rank` assumes is achieved: the share of the HBM bound
#: the measured CUDA FFI encoder reaches (docs/results.md), so a bound never outranks a measured kernel.
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

    Args: name: one of `BACKENDS`; platform: default jax's; n_devices: devices of the program (pallas
      on CPU is refused for n_devices > 1: its interpreter's host callbacks stall the program).
    Raises: ValueError for an unknown or unavailable name, listing what can run instead."""
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
