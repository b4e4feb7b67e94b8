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
#: The codec kinds are registered in `taco_jax.codec.kinds` (`codec_kinds()`: "none", the exact
#: collective, and every registered kind); every per-kind rule below derives from the registry.
SCALE_LAYOUTS = ("dual", "folded")
GROUP_AXES = ("hidden", "token")
NONFINITE_POLICIES = ("propagate", "zero", "error")


#: Implementations of the taco group math (registry: `taco_jax.codec.backends`; filled in by
#: `taco_jax.kernels`). "auto" (the default) and whether a backend runs here are resolved by
#: `taco_jax.codec.dispatch.resolve_codec`: once, before tracing, in training
#: (`CommPolicy.resolve_backends`); at trace time for a library call with an "auto" codec.
BACKENDS = ("reference", "pallas", "triton", "ffi", "auto")
#: Wire codecs (`CodecConfig.wire`; registry: `taco_jax.codec.backends.register_wire`): what turns a
#: message into the uint8 rows a collective moves, and rows back into values, sums or a requantized
#: sum. "generic" composes `encode` / `decode` of the group backend with byte packing
#: (`taco_jax.codec.wire`); "ffi" runs the C++ FFI kernels that read and write the rows themselves
#: (CPU; `taco_jax.kernels.ffi_codec`). "auto" (the default) is resolved with the backend.
WIRES = ("auto", "generic", "ffi")
#: How the exact (uncompressed) collectives move their data (`CodecConfig.transport`): "xla": the
#: `lax` collectives as XLA lowers them. "gloo": XLA:CPU runs the collectives through gloo
#: (`jax.distributed` initialized, CPU backend); then (1) the reduce-scatter, which gloo's
#: ReduceScatterHalvingDoubling intermittently gets wrong (jax-ml/jax#40830), runs as an
#: all-to-all plus a rank-order sum instead, and (2) messages of a float dtype narrower than 32
#: bits (bfloat16, float16), which XLA:CPU would widen to float32 on the wire, move as their own
#: bytes (bit-cast to unsigned integers, moved by all-to-all / all-gather / collective-permute,
#: summed in FP32 on the receiver), the bytes a GPU run (NCCL) moves. "gloo_widened": (1) only,
#: narrow floats moved as XLA:CPU widens them (the baseline before (2), kept for comparisons).
#: "auto" (the default) is resolved with the backend (`taco_jax.codec.dispatch.resolve_transport`).
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
      kind: which codec (all share `encode`/`decode` and move every wire buffer as data): a kind
        registered in `taco_jax.codec.kinds` (its entry gives the rules below), or "none"; built in:
        "none"        identity; the collective is the exact `lax` one.
        "fp8_tensor"  naive per-tensor FP8: one FP32 absmax scale per message (TransformerEngine
                      style), 1 + 4/n B/elt.
        "fp8_group"   FP8 per group of G, FP32 absmax scale, no transform (optional Hadamard),
                      1 + 4/G B/elt.
        "int8"        symmetric int8 per block of G, FP32 absmax scale (EQuARX / ZeRO++ style;
                      optional Hadamard for data-parallel use), 1 + 4/G B/elt.
        "int4"        symmetric 4-bit (levels -7..7) per group of G, FP32 absmax scale, two
                      codes per byte; with `hadamard=True` the SDP4Bit-style gradient codec,
                      0.5 + 4/G B/elt.
        "taco"        TACO (TACO_SPEC.md §2): RMS pre-scale, orthonormal WHT, FP8, 1 + 8/G
                      ("dual") or 1 + 4/G ("folded") B/elt.
        "tah"         TAH-Quant-style tiles for pipeline activations: orthonormal WHT per tile
                      of G, asymmetric 4-bit (min/max, 16 levels), FP32 scale and zero point,
                      0.5 + 8/G B/elt. Not implemented from TAH-Quant: entropy-guided 3/4-bit
                      allocation and pivot swapping (fixed 4 bits, plain Sylvester WHT).
      fmt: FP8 code format of the FP8 kinds, "e4m3" (F = 448) or "e5m2" (F = 57344).
      group_size: G, elements per group / block / tile, one of 32, 64, 128, 256, 512.
      lam: λ added to the group's mean square before TACO's adaptive scale (default 1e-6).
      target_range: R, the FP8 code range absmax values are mapped to (default 448); in (0, F].
      scale_layout: taco only: "dual" sends s and a as FP32 per group (the paper's wire
        format); "folded" sends the single scale s/a.
      group_axis: "hidden" groups contiguous elements of the flattened message (the spec);
        "token" groups one channel across tokens (the message's last axis is moved first).
        fp8_tensor has no groups and accepts "hidden" only.
      hadamard: fp8_group / int8 / int4 only: apply the orthonormal WHT to each group before
        quantizing (taco and tah always do; the others never).
      nonfinite: "propagate" (default): a group (fp8_tensor: the message) holding NaN/±Inf
        decodes to NaN, as an uncompressed sum would be non-finite (a two-shot all-reduce's
        partial sum that overflowed the message dtype from finite inputs is not such a group: it
        gives ±Inf in those elements only, as the exact sum, for the kinds with
        `CodecKind.overflow`; `taco_jax.codec.dispatch.overflow_groups`); "zero": the COCCL plugin's
        behaviour, NaN/Inf replaced by 0 before encoding and after decoding; "error": as
        "propagate", and a device-side check reports `site` to the host, where
        `taco_jax.codec.raise_if_nonfinite()` raises `FloatingPointError` naming it (the
        training loop calls it after every step; `taco_jax.codec.reference.check_finite`).
      site: name of the communication site, for "error" messages (`CommPolicy.codec_for` sets it).
      backend: which implementation runs the taco group math, one of `BACKENDS`. Default "auto":
        the fastest conforming backend on jax's default platform (C++ FFI on CPU when its library
        is built, else "reference" with a one-time warning; fused kernels on GPU), resolved by
        `taco_jax.kernels.resolve_codec` before tracing in training, or at trace time when a
        library call gets an "auto" codec. "reference" = plain jnp, the specification and the
        tests' oracle (see `taco_jax.kernels`). The other kinds always run the jnp reference.
        Only the name is checked here; availability (e.g. "triton" on CPU is refused, listing the
        available ones) is checked by `taco_jax.codec.dispatch.resolve_codec`.
      wire: kind "taco": the wire codec that packs messages into the rows the collectives move
        (one of `WIRES`): "generic" (`encode` / `decode` of `backend` plus byte packing) or "ffi"
        (the C++ FFI kernels read and write the rows themselves; CPU, backend "ffi", group_axis
        "hidden", nonfinite "propagate"; values bit-identical to "generic"). Default "auto": "ffi"
        where it can run, else "generic". Other kinds always use "generic".
      transport: how the exact collectives (kind "none", and a compressed collective's exact
        backward or below-threshold messages) move data, one of `TRANSPORTS`: "xla", "gloo" or
        "gloo_widened".
        Default "auto": the run's `--transport` where that is not "auto"
        (`resolve_codec(..., transport=...)`), else "gloo" when XLA:CPU runs the collectives through
        gloo (`jax.distributed` initialized, CPU backend), else "xla".
      All "auto" fields are resolved in one place, `taco_jax.codec.dispatch.resolve_codec`: once,
      before tracing, in training (`CommPolicy.resolve_backends`), or at trace time when a library
      call gets an unresolved codec.

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
          dtype: the message dtype (only "none" depends on it: its itemsize).
          n: elements per message. None gives the large-message limit (1 + 8/G, 1 + 4/G,
            0.5 + 4/G, ...; fp8_tensor 1.0); an int gives the exact figure, counting the
            zero-padded last group and, for a kind with one scale per message, that scale.
        Derived from the kind's registry entry: code bits, scale dtype, prescale, grouping.
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
