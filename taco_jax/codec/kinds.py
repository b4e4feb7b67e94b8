"""The codec kinds: one registry entry per kind, from which every per-kind rule of the package derives
(validation, wire layout, byte counts, calibration candidates, plots).

Adding a kind: `register_kind(CodecKind(...))` (docs/architecture.md, "Adding a codec kind")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from taco_jax.codec import family
from taco_jax.codec.constants import GROUP_SIZES

#: `CodecKind.hadamard` values.
HADAMARD = ("never", "optional", "always")
#: The FP8 code formats (`CodecConfig.fmt`) the calibration tries for a kind whose codes are FP8.
FP8_FMTS = ("e4m3", "e5m2")
#: (mantissa bits m, smallest subnormal 2^-d) of each FP8 code format (OCP OFP8 formats, arXiv 2209.05433).
FP8_BITS = {"e4m3": (3, 9), "e5m2": (2, 16)}
#: `Rounding.grid` values.
GRIDS = ("fp8", "int")


@dataclasses.dataclass(frozen=True)
class Rounding:
    """How one quantization of a group rounds: the error model each kind's tests bound it with
    (tests/test_codec_properties.py `group_bounds`, tests/test_codec_family.py `eps`).

    The group y (the kind's transform of x: identity, WHT, or taco's WHT(a·x)) is divided by a
    per-group scale s and u = y / s is rounded to a code:
    - grid "fp8": u in FP8 of `cfg.fmt`, s = max|y| / `cfg.target_range`; rounding costs at most
      2^-(m+1)·|u| + 2^-(d+1) (`FP8_BITS`).
    - grid "int": u to the nearest integer, s = max|y| / levels (symmetric, codes -L..L) or
      (max y - min y) / levels (asymmetric, codes 0..L above min y); rounding costs at most 1/2.

    Attributes:
      grid: "fp8" or "int".
      levels: "int": L above.
      symmetric: "int": the codes are -L..L (else 0..L from the group's minimum).
      rms_prescale: x is multiplied by a = clip(fmax / sqrt(mean(x²) + lam), 1e-3, 1e3) before the
        transform and the decode divides by a (taco, TACO_SPEC.md §2).
      source: where the rounding is defined.
    Raises: ValueError naming a bad field."""

    grid: str
    levels: int = 0
    symmetric: bool = True
    rms_prescale: bool = False
    source: str = ""

    def __post_init__(self):
        if self.grid not in GRIDS:
            raise ValueError(f"Rounding grid={self.grid!r} must be one of {GRIDS}")
        if (self.grid == "int") != (self.levels > 0):
            raise ValueError(f"Rounding levels={self.levels!r}: a positive L for grid 'int' only")

    def relative_l2(self, cfg, g: int) -> float:
        """Worst case over the data of ||x' - x||_2 / ||x||_2 for one quantization of a group of `g`
        elements by codec `cfg` (float32 arithmetic not counted): FP8 2^-(m+1) + 2^-(d+1)·sqrt(g)/R,
        int symmetric sqrt(g)/(2L), asymmetric sqrt(g)/L (the range is at most 2 max|y|). The
        transforms are orthonormal and a scales x and the error alike, so neither changes it."""
        if self.grid == "fp8":
            m, d = FP8_BITS[cfg.fmt]
            return 2.0 ** -(m + 1) + 2.0 ** -(d + 1) * np.sqrt(g) / cfg.target_range
        return float(np.sqrt(g) / (2 * self.levels if self.symmetric else self.levels))


@dataclasses.dataclass(frozen=True)
class CodecKind:
    """One codec kind (`CodecConfig.kind`).

    Attributes:
      name: the kind's name ("taco", "int8", ...); `--comm NAME`, `kind=NAME` in policy files.
      code_bits: bits per code on the wire (8; 4: two codes per byte, packed by the encoder).
      code_dtype: numpy dtype of the code buffer; None: FP8 in the codec's `fmt` (E4M3 / E5M2).
      encode: `encode(xg, cfg, *, last_count) -> (codes, scale, prescale)`: float32 groups [..., n_groups, G] (the
        last zero-padded past `last_count`) -> codes [..., n_groups, G * code_bits / 8], scale [..., n_groups],
        prescale like scale or None. A group holding NaN/±Inf must decode to NaN.
      decode: `decode(codes, scale, prescale, cfg) -> float32 groups [..., n_groups, G]`.
      scale_dtype: numpy dtype of the scale (and prescale) buffers (default float32).
      prescale: whether a second per-group buffer travels (a bool, or a function of the codec).
      grouped: one scale per group of G (True) or per message (False: `group_axis` "hidden" only).
      group_sizes: the group sizes G the kind takes (a subset of `constants.GROUP_SIZES`).
      hadamard: "never", "optional" (`CodecConfig.hadamard` chooses) or "always".
      scale_layouts: the `CodecConfig.scale_layout` values the kind takes.
      backends: the group math runs through the registered group backends and their wire codecs.
      transform_reduce: the two-shot all-reduce may sum in the transform domain.
      calibrate: `taco-jax calibrate` searches the kind.
      overflow: an overflowed two-shot partial-sum group travels as an overflow group
        (`dispatch.overflow_groups`; ±Inf in those elements only) instead of decoding to NaN.
        Needs FP8 codes (`code_dtype` None) and a float32 `scale_dtype`.
      rounding: how one quantization rounds (`Rounding`: the kind's error bound); None: undeclared (the
        codec tests refuse the kind).
      color: how plots draw the kind (a matplotlib colour).
      summary: one line for listings.
    Raises: ValueError naming a bad field."""

    name: str
    code_bits: int
    code_dtype: object
    encode: Callable
    decode: Callable
    scale_dtype: object = np.float32
    prescale: bool | Callable = False
    grouped: bool = True
    group_sizes: tuple[int, ...] = GROUP_SIZES
    hadamard: str = "never"
    scale_layouts: tuple[str, ...] = ("dual",)
    backends: bool = False
    transform_reduce: bool = False
    calibrate: bool = True
    overflow: bool = False
    rounding: Rounding | None = None
    color: str = "tab:brown"
    summary: str = ""

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name.isidentifier() and self.name != "none"):
            raise ValueError(f"name={self.name!r} must be an identifier other than 'none'")
        if self.code_bits not in (4, 8):
            raise ValueError(f"kind {self.name!r}: code_bits={self.code_bits!r} must be 4 or 8")
        if self.code_dtype is not None and np.dtype(self.code_dtype).itemsize * 8 != 8:
            raise ValueError(f"kind {self.name!r}: code_dtype={self.code_dtype!r} must be one byte wide (4-bit codes "
                             "travel packed two per byte)")
        if self.hadamard not in HADAMARD:
            raise ValueError(f"kind {self.name!r}: hadamard={self.hadamard!r} must be one of {HADAMARD}")
        bad = [g for g in self.group_sizes if g not in GROUP_SIZES]
        if not self.group_sizes or bad:
            raise ValueError(f"kind {self.name!r}: group_sizes={self.group_sizes!r} must be among {GROUP_SIZES}")
        if not self.grouped and self.hadamard != "never":
            raise ValueError(f"kind {self.name!r}: a kind with one scale per message has no groups to transform "
                             f"(hadamard={self.hadamard!r})")
        if not self.scale_layouts or "dual" not in self.scale_layouts:
            raise ValueError(f"kind {self.name!r}: scale_layouts={self.scale_layouts!r} must include 'dual' "
                             "(the default layout)")
        if self.rounding is not None and not isinstance(self.rounding, Rounding):
            raise ValueError(f"kind {self.name!r}: rounding={self.rounding!r} must be a Rounding or None")
        if self.rounding is not None and self.rounding.grid != ("fp8" if self.fp8 else "int"):
            raise ValueError(f"kind {self.name!r}: rounding grid {self.rounding.grid!r} does not match its codes "
                             f"(code_dtype={self.code_dtype!r})")
        if not callable(self.encode) or not callable(self.decode):
            raise ValueError(f"kind {self.name!r}: encode and decode must be callables")
        if self.overflow and not (self.fp8 and np.dtype(self.scale_dtype) == np.float32):
            raise ValueError(f"kind {self.name!r}: overflow=True needs FP8 codes (code_dtype None) and a "
                             "float32 scale_dtype")

    @property
    def fp8(self) -> bool:
        """The codes are FP8 in the codec's `fmt` (the `fmt` field applies)."""
        return self.code_dtype is None

    def has_prescale(self, cfg) -> bool:
        """Whether codec `cfg` of this kind sends a prescale buffer."""
        return self.prescale(cfg) if callable(self.prescale) else bool(self.prescale)

    def scale_bytes(self, cfg) -> int:
        """Scale bytes per group (per message when not `grouped`) of codec `cfg`."""
        return np.dtype(self.scale_dtype).itemsize * (2 if self.has_prescale(cfg) else 1)


_KINDS: dict[str, CodecKind] = {}


def register_kind(kind: CodecKind) -> CodecKind:
    """Adds `kind` to the registry (after the kinds already there). Returns it.
    Raises ValueError when a kind of that name is registered already."""
    if not isinstance(kind, CodecKind):
        raise ValueError(f"register_kind needs a CodecKind, got {kind!r}")
    if kind.name in _KINDS:
        raise ValueError(f"codec kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> CodecKind:
    """The registered kind `name`. Raises ValueError listing the registered kinds."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"kind={name!r} is not supported; choose one of {codec_kinds()}") from None


def codec_kinds() -> tuple[str, ...]:
    """"none" (the exact collective) and the registered kinds, in registration order."""
    return ("none", *_KINDS)


def registered() -> tuple[CodecKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())


# ----------------------------------------- the built-in kinds -----------------------------------------


def _plain(encode: Callable) -> Callable:
    """A group encoder that does not use `last_count`, in `CodecKind.encode`'s signature."""
    def enc(xg, cfg, *, last_count):
        del last_count
        return encode(xg, cfg)

    return enc


def _taco_encode(xg, cfg, *, last_count):
    """TACO's group math on the registered backend `cfg.backend`; "folded": the one scale s / a."""
    from taco_jax.codec.backends import get_backend

    codes, s, a = get_backend(cfg.backend).encode_groups(xg, cfg, last_count=last_count)
    if cfg.scale_layout == "folded":
        s, a = s / a, None
    return codes, s, a


def _taco_decode(codes, scale, prescale, cfg):
    from taco_jax.codec.backends import get_backend

    return get_backend(cfg.backend).decode_groups(codes, scale, prescale)


#: The built-in kinds' rounding (`Rounding`): FP8 of the absmax-scaled group, and the integer grids of
#: `family.encode_int` / `family.encode_tah`.
_FP8_ABSMAX = Rounding("fp8", source="codec/family.py encode_fp8: s = absmax / target_range")


def _int(name: str, levels: int, symmetric: bool = True) -> Rounding:
    return Rounding("int", levels, symmetric, source=f"codec/family.py {name}: {levels} levels")


for _kind in (
    CodecKind("fp8_tensor", 8, None, _plain(family.encode_fp8), family.decode_fp8, grouped=False, overflow=True,
              rounding=_FP8_ABSMAX, color="tab:gray", summary="FP8, one FP32 absmax scale per message"),
    CodecKind("fp8_group", 8, None, _plain(family.encode_fp8), family.decode_fp8, hadamard="optional",
              overflow=True, rounding=_FP8_ABSMAX, color="tab:blue", summary="FP8 per group of G, FP32 absmax scale"),
    CodecKind("int8", 8, np.int8, _plain(family.encode_int), family.decode_int, hadamard="optional",
              rounding=_int("encode_int", family.INT_LEVELS["int8"]),
              color="tab:green", summary="symmetric int8 per block of G, FP32 absmax scale"),
    CodecKind("int4", 4, np.uint8, _plain(family.encode_int), family.decode_int, hadamard="optional",
              rounding=_int("encode_int", family.INT_LEVELS["int4"]),
              color="tab:olive", summary="symmetric 4-bit per group of G, FP32 absmax scale"),
    CodecKind("taco", 8, None, _taco_encode, _taco_decode, prescale=lambda cfg: cfg.scale_layout == "dual",
              hadamard="always", scale_layouts=("dual", "folded"), backends=True, transform_reduce=True,
              overflow=True, rounding=Rounding("fp8", rms_prescale=True, source="TACO_SPEC.md §2"),
              color="tab:red", summary="TACO: RMS pre-scale, WHT, FP8 (TACO_SPEC.md §2)"),
    CodecKind("tah", 4, np.uint8, _plain(family.encode_tah), family.decode_tah, prescale=True, hadamard="always",
              rounding=_int("encode_tah", family.TAH_LEVELS, symmetric=False),
              color="tab:purple", summary="TAH-Quant-style WHT tiles, asymmetric 4-bit"),
):
    register_kind(_kind)
del _kind
