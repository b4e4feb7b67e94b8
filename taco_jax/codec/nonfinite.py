"""Host-side reporting of the "error" non-finite policy (`CodecConfig.nonfinite == "error"`).

A device-side check (`check_finite`) reports the communication site to the host through a
`jax.debug.callback`; the host keeps the reported sites until `nonfinite_sites` /
`raise_if_nonfinite` read them (the training loop calls the latter after every step).
"""

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

    Mechanism (works inside `jit`, `shard_map` and `custom_vjp` backward rules, jax >= 0.10.2):
    `lax.cond(all finite, nothing, jax.debug.callback(report))` — the callback takes no array
    operands and only runs on a rank that saw a non-finite value; it records the site and prints
    it. `raise_if_nonfinite()` then raises `FloatingPointError` naming the site(s) on the host
    (the training loop calls it after every step). Raising *inside* the callback is not used: on
    a multi-device mesh the failing rank leaves its peers waiting in the next collective, and
    XLA aborts the process; `checkify` is not used: it needs the caller to wrap the whole train
    step in `checkify.checkify`. The values themselves follow "propagate" (NaN out).
    """
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
