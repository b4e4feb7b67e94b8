"""Registry of the implementations ("backends") of the taco group math, filled in by their owners.

The codec defines the contract and looks a backend up by name; it never imports an
implementation. `taco_jax.codec.reference` registers "reference" (plain jnp, the
specification); `taco_jax.kernels` registers "pallas", "triton" and "ffi" when it is imported,
and the chooser of "auto" (`register_auto`). "auto" (the default of `CodecConfig.backend`) is
resolved in one of two places, both before a kernel is called:
  * training: once, before tracing (`taco_jax.kernels.resolve_codec`, `CommPolicy.resolve_backends`),
    so the run's policy, printed and stored in summary.json, names the concrete backend;
  * a library call with an "auto" codec (`encode(x, TACO)`, `collectives.psum(x, codec=TACO)`): at
    trace time, by `get_backend("auto")`, which asks the registered chooser (kernels: ffi on CPU
    when built, else reference with a one-time warning; GPU kernels on GPU) for jax's default
    platform, or gives "reference" when no chooser is registered (`taco_jax.kernels` not imported).

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
_AUTO: list[Callable[[], str]] = []  # the chooser of "auto" (at most one; `register_auto`)
_REDUCERS: dict[str, Callable] = {}


def register_reducer(name: str, fn: Callable) -> None:
    """Registers backend `name`'s transform-domain reduction (`reduce_groups` of the contract)."""
    _REDUCERS[name] = fn


def get_reducer(name: str) -> Callable | None:
    """Backend `name`'s `reduce_groups`, or None if it has none (then the reference's applies).
    "auto" is `resolve_auto()`'s, as in `get_backend`. Loads the backend first (`get_backend`),
    whose loader may register it."""
    if name == "auto":
        name = resolve_auto()
    get_backend(name)
    return _REDUCERS.get(name)


def register_backend(name: str, loader: Callable[[], GroupBackend]) -> None:
    """Registers `loader`, called on the first `get_backend(name)` (it may import, check that the
    backend runs here and raise ValueError saying why not). Re-registering replaces the entry."""
    _LOADERS[name] = loader
    _LOADED.pop(name, None)


def register_auto(chooser: Callable[[], str]) -> None:
    """Registers `chooser() -> name`, the concrete backend "auto" stands for (jax's default platform);
    `taco_jax.kernels` registers its `resolve("auto")`. Re-registering replaces it."""
    _AUTO[:] = [chooser]


def resolve_auto() -> str:
    """The concrete backend "auto" stands for here: the registered chooser's answer, or "reference"
    when nothing registered one (`taco_jax.kernels` not imported)."""
    return _AUTO[0]() if _AUTO else "reference"


def registered_backends() -> tuple[str, ...]:
    return tuple(_LOADERS)


def get_backend(name: str) -> GroupBackend:
    """The backend registered as `name` (loaded once per process); "auto" is `resolve_auto()`'s.

    Raises:
      ValueError: for a name nothing registered, or a backend that cannot run here (its loader's).
    """
    if name == "auto":
        name = resolve_auto()
    got = _LOADED.get(name)
    if got is not None:
        return got
    if name not in _LOADERS:
        raise ValueError(f"codec backend {name!r} is not registered (registered: {registered_backends()}); "
                         "`import taco_jax.kernels` registers pallas, triton and ffi")
    got = _LOADED[name] = _LOADERS[name]()
    return got
