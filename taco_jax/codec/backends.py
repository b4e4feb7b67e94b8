"""Registry of the implementations ("backends") of the taco group math, filled in by their owners.

The codec defines the contract and looks a backend up by name; it never imports an
implementation. `taco_jax.codec.reference` registers "reference" (plain jnp, the
specification); `taco_jax.kernels` registers "pallas", "triton" and "ffi" when it is imported,
and turns "auto" into one of them (`taco_jax.kernels.resolve_codec`,
`CommPolicy.resolve_backends`) before anything is traced, so "auto" never reaches a kernel.

Contract of a backend (spec §2 steps 1-5 and their inverse):
  encode_groups(xg, cfg, *, last_count) -> (codes, s, a)
    xg: float32 [..., n_groups, G], the last group zero-padded past `last_count` (1..G), G =
    cfg.group_size; codes: cfg.code_dtype [..., n_groups, G]; s, a: float32 [..., n_groups];
    a group holding NaN/±Inf gets s = NaN.
  decode_groups(codes, s, a) -> float32 [..., n_groups, G]; a=None for the folded layout.
Optional, registered apart (`register_reducer`; none registered: the reference's is used):
  reduce_groups(codes, s, a, cfg) -> (codes, s): the transform-domain reduction of the two-shot
    all-reduce (`taco_jax.codec.reference.reduce_groups`): codes [P, ..., n_groups, G] and
    s, a [P, ..., n_groups] of P ranks' messages -> the requantized sum, codes [..., n_groups, G]
    and s [..., n_groups] (folded layout: decode_groups(codes, s, None) gives the sum).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class GroupBackend(NamedTuple):
    """One implementation of the taco group math (contract in the module docstring)."""

    encode_groups: Callable
    decode_groups: Callable


_LOADERS: dict[str, Callable[[], GroupBackend]] = {}
_LOADED: dict[str, GroupBackend] = {}
_REDUCERS: dict[str, Callable] = {}


def register_reducer(name: str, fn: Callable) -> None:
    """Registers backend `name`'s transform-domain reduction (`reduce_groups` of the contract)."""
    _REDUCERS[name] = fn


def get_reducer(name: str) -> Callable | None:
    """Backend `name`'s `reduce_groups`, or None if it has none (then the reference's applies).
    Loads the backend first (`get_backend`), whose loader may register it."""
    get_backend(name)
    return _REDUCERS.get(name)


def register_backend(name: str, loader: Callable[[], GroupBackend]) -> None:
    """Registers `loader`, called on the first `get_backend(name)` (it may import, check that the
    backend runs here and raise ValueError saying why not). Re-registering replaces the entry."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def registered_backends() -> tuple[str, ...]:
    return tuple(_LOADERS)


def get_backend(name: str) -> GroupBackend:
    """The backend registered as `name` (loaded once per process).

    Raises:
      ValueError: for "auto" (resolve it first) or a name nothing registered.
    """
    got = _LOADED.get(name)
    if got is not None:
        return got
    if name == "auto":
        raise ValueError("codec backend 'auto' must be resolved to a concrete backend before encoding: "
                         "taco_jax.kernels.resolve_codec(cfg) or CommPolicy.resolve_backends()")
    if name not in _LOADERS:
        raise ValueError(f"codec backend {name!r} is not registered (registered: {registered_backends()}); "
                         "`import taco_jax.kernels` registers pallas, triton and ffi")
    got = _LOADED[name] = _LOADERS[name]()
    return got
