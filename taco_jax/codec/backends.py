"""Registries of the codec's implementations, filled in by their owners: group backends and wire codecs.

The codec defines the contracts and looks implementations up by name; it never imports one.
`codec.dispatch` registers the "reference" group backend (plain jnp, the specification) and
`codec.wire` the "generic" wire codec; importing `taco_jax.kernels` registers "pallas", "triton" and
"ffi", the "ffi" wire codec (CPU) and the backend resolver (`register_resolver`). Every "auto" is
resolved in `codec.dispatch.resolve_codec` for the platform traced for (`default_platform`).

Group backend (spec §2 steps 1-5 and their inverse):
  encode_groups(xg, cfg, *, last_count) -> (codes, s, a): xg float32 [..., n_groups, G] (G =
    cfg.group_size; the last group zero-padded past `last_count`); codes cfg.code_dtype
    [..., n_groups, G]; s, a float32 [..., n_groups]; a group holding NaN/±Inf gets s = NaN.
  decode_groups(codes, s, a) -> float32 [..., n_groups, G]; a=None for the folded layout.
Optional (`register_native`; default: float32 in and out, no fused sum):
  dtypes: message dtype names that encode_groups reads and decode_groups(..., dtype=d) writes directly, bit-identical to
    converting through float32 (decode clipped to d's range, `dispatch.clip_to_dtype`, rounded to nearest even).
  decode_sum_groups(codes, s, a, *, dtype) -> dtype [..., n_groups, G]: P ranks' groups (leading P
    axis; a=None: folded) decoded, summed in float32 in rank order, rounded once, not clipped (±Inf).
Optional (`register_reducer`; default: the reference's):
  reduce_groups(codes, s, a, cfg) -> (codes, s): the two-shot transform-domain reduction
    (`codec.reference.reduce_groups`): P ranks' groups -> the requantized sum in the folded layout.

Wire codec (`WireCodec`): messages <-> uint8 rows, one message per row as [codes][s][a] ([codes][s/a]
folded, `codec.wire.pack_rows`); every wire codec writes the same bytes and decodes bit-identically
to the generic one. `shape`/`dtype`: one message's; the rows' leading axes index messages.
  encode_rows(x, cfg, *, batch_dims=0, blocks=None, per_rank=False) -> uint8 [*batch, row_bytes]:
    x [*batch, *shape]; or blocks=(dim, P): x [*pre, P*s, *post], message r its block r along
    `dim`, giving [P, row_bytes]. per_rank: rows for an all-to-all.
  decode_rows(rows, cfg, shape, dtype, *, axis=0, overflow=False) -> dtype [*lead, *shape]:
    finite values clipped to dtype's range. axis (rows [P, row_bytes]): where P goes in the result.
    overflow: rows from `reduce_rows` ("signal") that may hold overflow groups (±Inf kept).
  decode_sum_rows(rows, cfg, shape, dtype) -> dtype [*shape]: rows [P, row_bytes] (or P buffers,
    `per_source`) decoded, summed in FP32 in rank order, cast.
  reduce_rows(rows, cfg, shape, dtype, domain) -> uint8 [row_bytes]: the two-shot middle step:
    "signal": the FP32 sum rounded to dtype and re-encoded (overflowed groups as overflow groups);
    "hadamard" (kind taco): `reduce_groups`, folded layout.
  per_source: received rows come as a sequence of P buffers rather than one [P, row_bytes] array.
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
    """Backend `name`'s `reduce_groups` ("auto" resolved, the backend loaded first), or None."""
    name = resolve_backend(name)
    get_backend(name)
    return _REDUCERS.get(name)


def register_native(name: str, dtypes: tuple[str, ...] = (), decode_sum_groups: Callable | None = None) -> None:
    """Registers the message dtypes backend `name` reads and writes natively and its fused
    `decode_sum_groups` (contract in the module docstring)."""
    names = tuple(getattr(d, "name", str(d)) for d in dtypes)  # numpy dtypes or their names
    _NATIVE[name] = NativeSupport(names, decode_sum_groups)


def get_native(name: str) -> NativeSupport:
    """Backend `name`'s `NativeSupport` ("auto" resolved, the backend loaded first; empty if none)."""
    name = resolve_backend(name)
    get_backend(name)
    return _NATIVE.get(name, NativeSupport())


def register_backend(name: str, loader: Callable[[], GroupBackend]) -> None:
    """Registers `loader`, called on the first `get_backend(name)` (it may raise ValueError saying why
    the backend cannot run here). Re-registering replaces the entry."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)
    _NATIVE.pop(name, None)


def register_resolver(resolver: Callable) -> None:
    """Registers `resolver(name, platform, *, n_devices) -> concrete backend name` (ValueError where
    it cannot run), replacing any earlier one."""
    _RESOLVER[:] = [resolver]


_ON_PIN: list[Callable[[], None]] = []  # caches to clear when the pinned platform changes (`register_pin_hook`)


def register_pin_hook(clear: Callable[[], None]) -> None:
    """Registers `clear()` (a backend's jit caches), called on entering and leaving `pin_platform`."""
    _ON_PIN.append(clear)


@contextlib.contextmanager
def pin_platform(platform: str, gpu_lowering: str = "triton"):
    """Traces the codec and its backends for `platform` ("cpu", "cuda", "rocm"; `gpu_lowering`: Pallas'
    "triton" or "mosaic_gpu") instead of jax's default, e.g. for a deviceless CUDA compile. Entered
    by `kernels.pallas_codec.lowering_platform`; the registered caches are cleared on entry and exit."""
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
    """The platform pinned by an enclosing `pin_platform`, else None."""
    pinned = PINNED.get()
    return None if pinned is None else pinned[0]


def default_platform() -> str:
    """The platform traced for, as `jax.export` spells it: the pinned one, else jax's default
    ("cpu", "cuda", "rocm" or "tpu"; "gpu" is "cuda")."""
    pinned = pinned_platform()
    if pinned is not None:
        return pinned
    p = jax.default_backend()
    return "cuda" if p == "gpu" else p


def resolve_backend(name: str, platform: str | None = None, *, n_devices: int = 1) -> str:
    """The concrete backend `name` stands for on `platform` (default `default_platform()`): the
    resolver's answer; without one, "reference" for "auto". Raises ValueError from the resolver."""
    if _RESOLVER:
        return _RESOLVER[0](name, platform, n_devices=n_devices)
    return "reference" if name == "auto" else name


def resolve_auto() -> str:
    """The concrete backend "auto" stands for here (`resolve_backend("auto")`)."""
    return resolve_backend("auto")


def get_backend(name: str) -> GroupBackend:
    """The backend registered as `name` (loaded once per process); "auto" is `resolve_auto()`'s.
    Raises: ValueError for a name nothing registered, or a backend that cannot run here."""
    if name == "auto":
        name = resolve_auto()
    return _load(name, _LOADED, _LOADERS, "codec backend", "pallas, triton and ffi")


def _load(name: str, loaded: dict, loaders: dict, what: str, kernels_register: str):
    """`loaded[name]`, loaded once by `loaders[name]`. Raises ValueError for an unregistered name."""
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
    """Registers wire codec `name` (`loader()` called on first use; `platforms`: where it runs, empty
    for everywhere). A non-"generic" wire codec runs the same-named backend's group math."""
    _WIRE_LOADERS[name] = (loader, tuple(platforms))
    _WIRE_LOADED.pop(name, None)


def wire_runs_on(name: str, platform: str) -> bool:
    """Whether wire codec `name` is registered and runs on `platform`."""
    entry = _WIRE_LOADERS.get(name)
    return entry is not None and (not entry[1] or platform in entry[1])


def get_wire(name: str) -> WireCodec:
    """The wire codec registered as `name` (loaded once per process).
    Raises: ValueError for a name nothing registered."""
    return _load(name, _WIRE_LOADED, _WIRE_LOADERS, "wire codec", "ffi")
