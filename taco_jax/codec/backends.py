"""Registries of the implementations of the codec, filled in by their owners: group backends and wire codecs.

The codec defines the contracts and looks implementations up by name; it never imports one.
`taco_jax.codec.dispatch` registers the "reference" group backend (plain jnp, the specification)
and `taco_jax.codec.wire` the "generic" wire codec; `taco_jax.kernels` registers the "pallas",
"triton" and "ffi" group backends, the "ffi" wire codec (CPU) and the resolver of backend names
(`register_resolver`: which backend "auto" stands for, and whether a named one can run here)
when it is imported. Every "auto" of a `CodecConfig` is resolved in one place,
`taco_jax.codec.dispatch.resolve_codec`, which asks these registries, for the platform the codec is
traced for (`default_platform`: jax's, or the one `kernels.pallas_codec.lowering_platform` pins).

Contract of a group backend (spec §2 steps 1-5 and their inverse):
  encode_groups(xg, cfg, *, last_count) -> (codes, s, a)
    xg: float32 [..., n_groups, G], the last group zero-padded past `last_count` (1..G), G =
    cfg.group_size; codes: cfg.code_dtype [..., n_groups, G]; s, a: float32 [..., n_groups];
    a group holding NaN/±Inf gets s = NaN.
  decode_groups(codes, s, a) -> float32 [..., n_groups, G]; a=None for the folded layout.
Optional, registered apart (`register_native`; none registered: float32 in and out, no fused sum):
  dtypes: names of the message dtypes ("bfloat16", "float16", ...) that encode_groups
    reads as they are (xg in that dtype; no convert to float32 before it) and that
    decode_groups(codes, s, a, dtype=...) writes directly, its finite values clipped to the
    dtype's range (`dispatch.clip_to_dtype`) and rounded to nearest even: for such a dtype d,
    encode_groups(xg in d) is bit-identical to encode_groups(xg.astype(float32)), and
    decode_groups(..., dtype=d) to clip_to_dtype(decode_groups(...), d).astype(d), so the
    dispatcher runs no convert before or after the backend;
  decode_sum_groups(codes, s, a, *, dtype) -> dtype [..., n_groups, G]: P ranks' groups
    (codes [P, ..., n_groups, G], s, a [P, ..., n_groups]) decoded and summed in float32 in rank
    order, then rounded to dtype once, not clipped: a sum beyond dtype's range is ±Inf, as the
    exact sum (used by `dispatch.decode_sum`; dtype float32 or a native one).
Optional, registered apart (`register_reducer`; none registered: the reference's is used):
  reduce_groups(codes, s, a, cfg) -> (codes, s): the transform-domain reduction of the two-shot
    all-reduce (`taco_jax.codec.reference.reduce_groups`): codes [P, ..., n_groups, G] and
    s, a [P, ..., n_groups] of P ranks' messages -> the requantized sum, codes [..., n_groups, G]
    and s [..., n_groups] (folded layout: decode_groups(codes, s, None) gives the sum).

Contract of a wire codec (`WireCodec`): messages <-> the uint8 rows the collectives move. A row
holds one message's wire buffers as bytes, [codes][s][a] ([codes][s/a] folded), the layout
`taco_jax.codec.wire.pack_rows` gives; every wire codec writes and reads the same bytes and
gives values bit-identical to the generic one. `shape` is the shape of one message and `dtype`
its dtype; the rows' leading axes index messages.
  encode_rows(x, cfg, *, batch_dims=0, blocks=None, per_rank=False) -> uint8 [*batch, row_bytes]
    x: float [*batch, *shape] (messages along the leading `batch_dims` axes); or, with
    blocks=(dim, P), x [*pre, P*s, *post] holding P messages, message r its block r along `dim`
    ([*pre, s, *post]), giving rows [P, row_bytes]. per_rank: the rows are for an all-to-all (the
    wire codec may lay them out as one buffer per destination).
  decode_rows(rows, cfg, shape, dtype, *, axis=0, overflow=False) -> dtype [*lead, *shape]
    rows [*lead, row_bytes]; finite values clipped to dtype's range before the cast
    (`dispatch.clip_to_dtype`). axis (rows [P, row_bytes] only): where the P axis goes:
    [*shape[:axis], P, *shape[axis:]]. overflow: the rows are `reduce_rows` ("signal") results and
    may hold overflow groups (`dispatch.overflow_groups`), decoded as such (±Inf where the sum
    overflowed).
  decode_sum_rows(rows, cfg, shape, dtype) -> dtype [*shape]
    rows: uint8 [P, row_bytes], or the sequence of P rows an all-to-all delivered (`per_source`);
    the P messages decoded and summed in FP32 in rank order, then cast.
  reduce_rows(rows, cfg, shape, dtype, domain) -> uint8 [row_bytes]
    the middle step of the two-shot all-reduce on received rows (as `decode_sum_rows` takes
    them): "signal": the FP32 sum rounded to dtype and encoded again, a group in which it
    overflowed (±Inf, no NaN) as an overflow group (`encode(..., overflow=True)`); "hadamard"
    (kind taco): `reduce_groups`, the sum's rows in the folded layout.
  per_source: whether the rows an all-to-all delivers are handed to decode_sum_rows / reduce_rows
    as a sequence of P buffers (one per source rank) rather than one [P, row_bytes] array.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import NamedTuple

import jax


class GroupBackend(NamedTuple):
    """One implementation of the taco group math (contract in the module docstring)."""

    encode_groups: Callable
    decode_groups: Callable


class NativeSupport(NamedTuple):
    """What a group backend takes beyond float32 (contract in the module docstring)."""

    dtypes: tuple[str, ...] = ()
    decode_sum_groups: Callable | None = None


class WireCodec(NamedTuple):
    """One implementation of the wire rows (contract in the module docstring)."""

    encode_rows: Callable
    decode_rows: Callable
    decode_sum_rows: Callable
    reduce_rows: Callable
    per_source: bool = False


_LOADERS: dict[str, Callable[[], GroupBackend]] = {}
_LOADED: dict[str, GroupBackend] = {}
_RESOLVER: list[Callable] = []  # at most one (`register_resolver`)
#: (platform, gpu_lowering) pinned by `taco_jax.kernels.pallas_codec.lowering_platform`, else None.
PINNED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("taco_platform", default=None)
_REDUCERS: dict[str, Callable] = {}
_NATIVE: dict[str, NativeSupport] = {}
_WIRE_LOADERS: dict[str, tuple[Callable[[], WireCodec], tuple[str, ...]]] = {}
_WIRE_LOADED: dict[str, WireCodec] = {}


def register_reducer(name: str, fn: Callable) -> None:
    """Registers backend `name`'s transform-domain reduction (`reduce_groups` of the contract)."""
    _REDUCERS[name] = fn


def get_reducer(name: str) -> Callable | None:
    """Backend `name`'s `reduce_groups`, or None if it has none (then the reference's applies).
    "auto" is `resolve_backend("auto")`'s. Loads the backend first (`get_backend`), whose loader
    may register it."""
    name = resolve_backend(name)
    get_backend(name)
    return _REDUCERS.get(name)


def register_native(name: str, dtypes: tuple[str, ...] = (), decode_sum_groups: Callable | None = None) -> None:
    """Registers the message dtypes backend `name` reads and writes natively and its fused
    `decode_sum_groups` (contract in the module docstring)."""
    names = tuple(getattr(d, "name", str(d)) for d in dtypes)  # numpy dtypes or their names
    _NATIVE[name] = NativeSupport(names, decode_sum_groups)


def get_native(name: str) -> NativeSupport:
    """Backend `name`'s `NativeSupport` (empty if none registered); "auto" is resolved first. Loads
    the backend first (`get_backend`), whose loader may register it."""
    name = resolve_backend(name)
    get_backend(name)
    return _NATIVE.get(name, NativeSupport())


def register_backend(name: str, loader: Callable[[], GroupBackend]) -> None:
    """Registers `loader`, called on the first `get_backend(name)` (it may import, check that the
    backend runs here and raise ValueError saying why not). Re-registering replaces the entry."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)
    _NATIVE.pop(name, None)


def register_resolver(resolver: Callable) -> None:
    """Registers `resolver(name, platform, *, n_devices) -> concrete backend name` (it raises
    ValueError for a backend that cannot run on `platform`); `taco_jax.kernels` registers `resolve`.
    Re-registering replaces it."""
    _RESOLVER[:] = [resolver]


_ON_PIN: list[Callable[[], None]] = []  # caches to clear when the pinned platform changes (`register_pin_hook`)


def register_pin_hook(clear: Callable[[], None]) -> None:
    """Registers `clear()`, called on entering and leaving `pin_platform` (a backend's jit caches of
    traces made for another platform; `taco_jax.kernels.pallas_codec` registers its kernels')."""
    _ON_PIN.append(clear)


@contextlib.contextmanager
def pin_platform(platform: str, gpu_lowering: str = "triton"):
    """Traces the codec and its backends for `platform` ("cpu", "cuda", "rocm"; `gpu_lowering`: Pallas'
    "triton" or "mosaic_gpu") instead of jax's default platform, e.g. a train step compiled for abstract
    CUDA devices on a CPU-only machine (`train.deviceless`). `kernels.pallas_codec.lowering_platform`
    checks its arguments and enters this. The registered caches are cleared on entry and exit."""
    for clear in _ON_PIN:
        clear()
    token = PINNED.set((platform, gpu_lowering))
    try:
        yield
    finally:
        PINNED.reset(token)
        for clear in _ON_PIN:
            clear()


def pinned_platform() -> str | None:
    """The platform pinned by an enclosing `taco_jax.kernels.pallas_codec.lowering_platform(...)`,
    else None."""
    pinned = PINNED.get()
    return None if pinned is None else pinned[0]


def default_platform() -> str:
    """The platform the codec and its kernels are traced for (name as `jax.export` spells it): the
    pinned one (`pinned_platform`), else jax's default platform: "cpu", "cuda", "rocm" or "tpu"
    ("gpu" is reported as "cuda")."""
    pinned = pinned_platform()
    if pinned is not None:
        return pinned
    p = jax.default_backend()
    return "cuda" if p == "gpu" else p


def resolve_backend(name: str, platform: str | None = None, *, n_devices: int = 1) -> str:
    """The concrete group backend `name` stands for on `platform` (default: `default_platform()`):
    the registered resolver's answer; without one (`taco_jax.kernels` not imported), "reference"
    for "auto" and the name itself otherwise. Raises ValueError from the resolver."""
    if _RESOLVER:
        return _RESOLVER[0](name, platform, n_devices=n_devices)
    return "reference" if name == "auto" else name


def resolve_auto() -> str:
    """The concrete backend "auto" stands for here (`resolve_backend("auto")`)."""
    return resolve_backend("auto")


def get_backend(name: str) -> GroupBackend:
    """The backend registered as `name` (loaded once per process); "auto" is `resolve_auto()`'s.

    Raises:
      ValueError: for a name nothing registered, or a backend that cannot run here (its loader's).
    """
    if name == "auto":
        name = resolve_auto()
    return _load(name, _LOADED, _LOADERS, "codec backend", "pallas, triton and ffi")


def _load(name: str, loaded: dict, loaders: dict, what: str, kernels_register: str):
    """`loaded[name]`, loading it with `loaders[name]` (a loader, or a (loader, ...) tuple) once.
    Raises ValueError for a name nothing registered."""
    got = loaded.get(name)
    if got is not None:
        return got
    if name not in loaders:
        raise ValueError(f"{what} {name!r} is not registered (registered: {tuple(loaders)}); "
                         f"`import taco_jax.kernels` registers {kernels_register}")
    loader = loaders[name]
    got = loaded[name] = (loader[0] if isinstance(loader, tuple) else loader)()
    return got


def register_wire(name: str, loader: Callable[[], WireCodec], platforms: tuple[str, ...] = ()) -> None:
    """Registers wire codec `name`: `loader()` is called on its first use; `platforms` lists where it
    runs (empty: everywhere). A wire codec other than "generic" runs the group math of the backend
    of the same name. Re-registering replaces the entry."""
    _WIRE_LOADERS[name] = (loader, tuple(platforms))
    _WIRE_LOADED.pop(name, None)


def wire_runs_on(name: str, platform: str) -> bool:
    """Whether wire codec `name` is registered and runs on `platform`."""
    entry = _WIRE_LOADERS.get(name)
    return entry is not None and (not entry[1] or platform in entry[1])


def get_wire(name: str) -> WireCodec:
    """The wire codec registered as `name` (loaded once per process).

    Raises: ValueError for a name nothing registered.
    """
    return _load(name, _WIRE_LOADED, _WIRE_LOADERS, "wire codec", "ffi")
