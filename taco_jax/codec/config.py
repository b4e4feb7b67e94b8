"""Frozen, hashable codec configuration (TACO spec §2; usable as a static argument to `jit`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

#: FP8 formats: name -> (jnp dtype, largest finite value F). Source: OCP FP8 spec via ml_dtypes.
FP8_FORMATS = {
    "e4m3": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
}
GROUP_SIZES = (32, 64, 128, 256, 512)
CODEC_KINDS = ("none", "taco")
SCALE_LAYOUTS = ("dual", "folded")
GROUP_AXES = ("hidden", "token")
NONFINITE_POLICIES = ("propagate", "zero")


def fp8_max(fmt: str) -> float:
    """Largest finite value of an FP8 format: 448.0 (E4M3) or 57344.0 (E5M2)."""
    return float(ml_dtypes.finfo(FP8_FORMATS[fmt]).max)


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {allowed}")


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """How one message is compressed.

    Attributes:
      kind: "none" (identity; the collective is the exact `lax` one) or "taco".
      fmt: FP8 code format, "e4m3" (F = 448) or "e5m2" (F = 57344).
      group_size: G, elements per group, one of 32, 64, 128, 256, 512 (spec §2; default 128).
      lam: λ added to the group's mean square before the adaptive scale (default 1e-6).
      target_range: R, the code range the transformed absmax is mapped to (default 448);
        must be in (0, F].
      scale_layout: "dual" sends s and a as FP32 per group (1 + 8/G B/elt, the paper's
        wire format); "folded" sends the single scale s/a (1 + 4/G B/elt).
      group_axis: "hidden" groups contiguous elements of the flattened message (the spec);
        "token" groups one channel across tokens (the message's last axis is moved first).
      nonfinite: "propagate" (default): a group holding NaN/±Inf decodes to NaN, as an
        uncompressed sum would be non-finite; "zero": the COCCL plugin's behaviour, NaN/Inf
        replaced by 0 before encoding and after decoding.
      backend: which implementation runs the group math ("reference" = plain jnp).

    Raises:
      ValueError: on any value outside the sets above, naming it.
    """

    kind: str = "taco"
    fmt: str = "e4m3"
    group_size: int = 128
    lam: float = 1e-6
    target_range: float = 448.0
    scale_layout: str = "dual"
    group_axis: str = "hidden"
    nonfinite: str = "propagate"
    backend: str = "reference"

    def __post_init__(self):
        _check("kind", self.kind, CODEC_KINDS)
        _check("fmt", self.fmt, tuple(FP8_FORMATS))
        _check("group_size", self.group_size, GROUP_SIZES)
        _check("scale_layout", self.scale_layout, SCALE_LAYOUTS)
        _check("group_axis", self.group_axis, GROUP_AXES)
        _check("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if not self.lam >= 0:
            raise ValueError(f"lam={self.lam!r} must be >= 0")
        f = fp8_max(self.fmt)
        if not 0 < self.target_range <= f:
            raise ValueError(f"target_range={self.target_range!r} must be in (0, {f}] for fmt={self.fmt!r}")

    @property
    def code_dtype(self):
        return FP8_FORMATS[self.fmt]

    @property
    def fmax(self) -> float:
        return fp8_max(self.fmt)

    def wire_bytes_per_element(self, dtype=jnp.float32) -> float:
        """Bytes on the wire per message element: itemsize for "none", 1 + 8/G or 1 + 4/G."""
        if self.kind == "none":
            return float(np.dtype(dtype).itemsize)
        return 1.0 + (8.0 if self.scale_layout == "dual" else 4.0) / self.group_size


NONE = CodecConfig(kind="none")
TACO = CodecConfig()
