"""Frozen, hashable codec configuration for every codec of the family (usable as a static `jit` argument)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from taco_jax.codec.constants import DEFAULT_LAM, E4M3_MAX, GROUP_SIZES
from taco_jax.codec.kinds import get_kind, registered

#: FP8 formats: name -> (jnp dtype, largest finite value F). Source: OCP FP8 spec via ml_dtypes.
FP8_FORMATS = {
    "e4m3": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
}
#: Codec kinds: "none" and the kinds registered in `taco_jax.codec.kinds`, whose entries give every per-kind rule below.
SCALE_LAYOUTS = ("dual", "folded")
GROUP_AXES = ("hidden", "token")
NONFINITE_POLICIES = ("propagate", "zero", "error")


#: Implementations of the taco group math (registry `taco_jax.codec.backends`, filled by
#: `taco_jax.kernels`); "auto" resolved by `taco_jax.codec.dispatch.resolve_codec`.
BACKENDS = ("reference", "pallas", "triton", "ffi", "auto")
#: Wire codecs (registry `codec.backends.register_wire`): "generic" = the group backend's encode/decode plus byte
#: packing (`codec.wire`); "ffi" = C++ kernels that read and write the rows (CPU, `kernels.ffi_codec`).
WIRES = ("auto", "generic", "ffi")
#: How exact collectives move data: "xla": as XLA lowers them. "gloo" (XLA:CPU under
#: `jax.distributed`): (1) the reduce-scatter runs as all-to-all + rank-order sum (gloo's
#: ReduceScatterHalvingDoubling is intermittently wrong, jax-ml/jax#40830) and (2) floats narrower
#: than 32 bits move as their own bytes (bit-cast, summed in FP32 on the receiver), as NCCL would,
#: not widened to float32. "gloo_widened": (1) only. "auto": `codec.dispatch.resolve_transport`.
TRANSPORTS = ("auto", "xla", "gloo", "gloo_widened")


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
      kind: "none" (the exact `lax` collective) or a kind registered in `taco_jax.codec.kinds`; built
        in (bytes per element on the wire):
        "fp8_tensor"  FP8, one FP32 absmax scale per message (TransformerEngine style), 1 + 4/n.
        "fp8_group"   FP8 per group of G, FP32 absmax scale (optional Hadamard), 1 + 4/G.
        "int8"        symmetric int8 per block of G, FP32 absmax scale (EQuARX / ZeRO++), 1 + 4/G.
        "int4"        symmetric 4-bit (-7..7) per group, two per byte (SDP4Bit with Hadamard), 0.5 + 4/G.
        "taco"        TACO (TACO_SPEC.md §2): RMS pre-scale, WHT, FP8, 1 + 8/G ("dual"), 1 + 4/G ("folded").
        "tah"         TAH-Quant-style WHT tiles, asymmetric 4-bit, FP32 scale and zero point, 0.5 + 8/G
                      (without TAH-Quant's entropy-guided bit allocation and pivot swapping).
      fmt: FP8 code format, "e4m3" (F = 448) or "e5m2" (F = 57344).
      group_size: G, elements per group, one of 32, 64, 128, 256, 512.
      lam: λ added to the group's mean square before TACO's adaptive scale (default 1e-6).
      target_range: R, the code range absmax values map to (default 448); in (0, F].
      scale_layout: taco only: "dual" sends s and a per group (the paper's); "folded" sends s/a.
      group_axis: "hidden" groups contiguous elements of the flattened message (the spec); "token"
        groups one channel across tokens (fp8_tensor: "hidden" only).
      hadamard: fp8_group / int8 / int4 only: the orthonormal WHT per group before quantizing
        (taco and tah always transform).
      nonfinite: "propagate" (default): a group (fp8_tensor: the message) holding NaN/±Inf decodes
        to NaN (a two-shot partial sum that overflowed from finite inputs gives ±Inf in those
        elements only, `codec.dispatch.overflow_groups`); "zero": NaN/Inf replaced by 0 before
        encoding and after decoding (the COCCL plugin's behaviour); "error": as "propagate", and
        `taco_jax.codec.raise_if_nonfinite()` raises `FloatingPointError` naming `site`.
      site: the communication site named by "error" (`CommPolicy.codec_for` sets it).
      backend: the implementation of the taco group math, one of `BACKENDS`; "reference" is plain
        jnp, the specification. Default "auto": the fastest conforming one on the platform. Other
        kinds always run the reference. Availability is checked at resolution, not here.
      wire: kind "taco": "generic" or "ffi" (CPU, backend "ffi", group_axis "hidden", nonfinite
        "propagate"; bit-identical to "generic"). Default "auto": "ffi" where it runs.
      transport: how exact collectives (kind "none", exact backward, below-threshold messages)
        move data, one of `TRANSPORTS`. Default "auto": the run's `--transport`, else "gloo" under
        XLA:CPU with `jax.distributed`, else "xla".
      Every "auto" is resolved by `taco_jax.codec.dispatch.resolve_codec`: before tracing in
      training (`CommPolicy.resolve_backends`), at trace time in a library call.

    Raises:
      ValueError: on any value outside the sets above, naming it.
    """

    kind: str = "taco"
    fmt: str = "e4m3"
    group_size: int = 128
    lam: float = DEFAULT_LAM
    target_range: float = E4M3_MAX
    scale_layout: str = "dual"
    group_axis: str = "hidden"
    nonfinite: str = "propagate"
    backend: str = "auto"
    hadamard: bool = False
    wire: str = "auto"
    transport: str = "auto"
    site: str = ""

    def __post_init__(self):
        spec = get_kind(self.kind) if self.kind != "none" else None  # ValueError naming an unknown kind
        _check("fmt", self.fmt, tuple(FP8_FORMATS))
        _check("group_size", self.group_size, GROUP_SIZES)
        _check("scale_layout", self.scale_layout, SCALE_LAYOUTS)
        _check("group_axis", self.group_axis, GROUP_AXES)
        _check("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _check("backend", self.backend, BACKENDS)
        _check("wire", self.wire, WIRES)
        _check("transport", self.transport, TRANSPORTS)
        if self.wire not in ("auto", "generic") and not (
                spec is not None and spec.backends and self.group_axis == "hidden" and self.nonfinite == "propagate"
                and self.backend in (self.wire, "auto")):
            kinds = " or ".join(repr(k.name) for k in registered() if k.backends)
            raise ValueError(f"wire={self.wire!r} needs kind={kinds}, group_axis='hidden', nonfinite='propagate' "
                             f"and backend {self.wire!r} or 'auto' (got kind={self.kind!r}, "
                             f"group_axis={self.group_axis!r}, nonfinite={self.nonfinite!r}, "
                             f"backend={self.backend!r}); use wire='generic'")
        if not self.lam >= 0:
            raise ValueError(f"lam={self.lam!r} must be >= 0")
        f = fp8_max(self.fmt)
        if not 0 < self.target_range <= f:
            raise ValueError(f"target_range={self.target_range!r} must be in (0, {f}] for fmt={self.fmt!r}")
        if self.scale_layout != "dual" and (spec is None or self.scale_layout not in spec.scale_layouts):
            takes = [k.name for k in registered() if self.scale_layout in k.scale_layouts]
            where = f"kind={takes[0]!r}" if len(takes) == 1 else f"kinds {tuple(takes)}"
            raise ValueError(f"scale_layout={self.scale_layout!r} applies to {where} only, not kind={self.kind!r}")
        if self.hadamard and (spec is None or spec.hadamard != "optional"):
            optional = tuple(k.name for k in registered() if k.hadamard == "optional")
            always = " and ".join(k.name for k in registered() if k.hadamard == "always")
            raise ValueError(f"hadamard=True applies to kinds {optional} only ({always} always "
                             f"transform), not kind={self.kind!r}")
        if spec is not None and not spec.grouped and self.group_axis != "hidden":
            raise ValueError(f"group_axis={self.group_axis!r}: kind={self.kind!r} has one scale per message, "
                             "no groups; use group_axis='hidden'")
        if spec is not None and spec.grouped and self.group_size not in spec.group_sizes:
            raise ValueError(f"group_size={self.group_size!r}: kind={self.kind!r} takes group sizes "
                             f"{spec.group_sizes}")
        if not isinstance(self.site, str):
            raise ValueError(f"site={self.site!r} must be a string")

    @property
    def code_dtype(self):
        """dtype of the code buffer on the wire (the kind's: FP8 in `fmt`, int8, or uint8 holding two
        4-bit codes per byte); None for kind "none"."""
        if self.kind == "none":
            return None
        spec = get_kind(self.kind)
        return FP8_FORMATS[self.fmt] if spec.fp8 else spec.code_dtype

    @property
    def scale_dtype(self):
        """dtype of the scale (and prescale) buffers on the wire (the kind's; float32 for the built-in
        kinds); None for kind "none"."""
        return None if self.kind == "none" else get_kind(self.kind).scale_dtype

    @property
    def fmax(self) -> float:
        return fp8_max(self.fmt)

    @property
    def transforms(self) -> bool:
        """Whether each group goes through the orthonormal Walsh-Hadamard transform."""
        return self.hadamard or (self.kind != "none" and get_kind(self.kind).hadamard == "always")

    @property
    def name(self) -> str:
        """Short readable label, e.g. "taco-e4m3-G128-dual", "int8-G64-token", "int4-G128-had"."""
        if self.kind == "none":
            return "none"
        spec = get_kind(self.kind)
        parts = [self.kind]
        if spec.fp8:
            parts.append(self.fmt)
        if spec.grouped:
            parts.append(f"G{self.group_size}")
        if len(spec.scale_layouts) > 1:
            parts.append(self.scale_layout)
        if self.hadamard:
            parts.append("had")
        if self.group_axis != "hidden":
            parts.append(self.group_axis)
        return "-".join(parts)

    def wire_bytes_per_element(self, dtype=jnp.float32, n: int | None = None) -> float:
        """Bytes on the wire per message element.

        Args:
          dtype: the message dtype (used by kind "none" only: its itemsize).
          n: elements per message; None gives the large-message limit (e.g. 1 + 8/G), an int the
            exact figure with the zero-padded last group (or the per-message scale).
        """
        if self.kind == "none":
            return float(np.dtype(dtype).itemsize)
        spec = get_kind(self.kind)
        code, scale = spec.code_bits / 8, spec.scale_bytes(self)
        if not spec.grouped:
            return code + (scale / n if n else 0.0)
        g = self.group_size
        if n is None:
            return code + scale / g
        n_groups = math.ceil(n / g)
        return (n_groups * g * code + scale * n_groups) / n

    def to_dict(self) -> dict:
        """The fields that differ from the defaults (always with `kind`): a policy-file entry."""
        out = {"kind": self.kind}
        for f in dataclasses.fields(self):
            if f.name not in ("kind", "site") and getattr(self, f.name) != f.default:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "codec") -> CodecConfig:
        """Inverse of `to_dict`. Raises ValueError naming `where` for an unknown field or bad value."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping of codec fields, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown codec field(s) {unknown}; known fields: {sorted(known)}")
        try:
            return cls(**d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from e


NONE = CodecConfig(kind="none")
TACO = CodecConfig()
