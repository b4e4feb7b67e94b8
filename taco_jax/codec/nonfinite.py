"""Host-side reporting of the "error" non-finite policy (`CodecConfig.nonfinite == "error"`):
`check_finite` reports a site from the device, `raise_if_nonfinite` raises on the host."""

from __future__ import annotations

import functools
import sys
import threading

import jax
import jax.numpy as jnp

_SITES: list[str] = []  # sites whose check saw NaN/Inf, in report order (callbacks may run on any thread)
_LOCK = threading.Lock()


def _report(*, site: str):
    site = site or "<unnamed>"
    with _LOCK:
        first = site not in _SITES
        _SITES.append(site)
    if first:
        print(f"taco_jax: non-finite value (NaN/Inf) in a message at site {site!r}", file=sys.stderr)


def check_finite(rows: jax.Array, site: str) -> None:
    """The "error" policy's device-side check: reports `site` to the host if `rows` holds NaN/±Inf.

    A `lax.cond` around an operand-free `jax.debug.callback` (works in `jit`, `shard_map` and custom_vjp rules). Not
    raising inside the callback: the failing rank would leave its peers waiting in the next collective. Not
    `checkify`: it would wrap the whole step. Values follow "propagate"."""
    ok = jnp.all(jnp.isfinite(rows))
    jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(functools.partial(_report, site=site)))


def nonfinite_sites(clear: bool = True) -> list[str]:
    """Sites reported by the "error" policy since the last call, first report first (waits for pending callbacks)."""
    jax.effects_barrier()
    with _LOCK:
        sites = list(dict.fromkeys(_SITES))
        if clear:
            _SITES.clear()
    return sites


def raise_if_nonfinite():
    """Raises FloatingPointError naming every site whose "error"-policy check saw NaN/Inf (then clears)."""
    sites = nonfinite_sites()
    if sites:
        raise FloatingPointError(f"non-finite value (NaN/Inf) in a compressed message at site(s) {sites} "
                                 "(codec nonfinite='error')")
