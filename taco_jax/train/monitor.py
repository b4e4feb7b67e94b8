"""Online fidelity monitor (`taco-jax train --monitor-every N`): per-site SQNR of the compressed
tensor-parallel collectives against the exact ones, measured on the run's own messages.

Step k is monitored when k % N == 0 or k is the run's last step (`monitor_due`); the train step's compiled program
is the same with or without the monitor. Before a monitored step trains, `Monitor.measure` runs one jitted function on
its parameters and batch: the capture twin (`capture.make_message_fn`) yields every TP message, and each message x of
a compressed tensor site goes through the site's collective (`collectives.megatron.site_collective`) with the run's
codec (y) and exact; four float32 numbers per message (Σx², Σ(y−x)², max|y−x|, max|x|, over all devices) leave the
accelerator. Per compressed site the step's `metrics.jsonl` record gets under "monitor" (a site's "calls": its
messages in one step): sqnr_db = 10·log10(Σ_calls Σx² / Σ_calls Σ(y−x)²), min_sqnr_db and worst_call (the worst call
and its role, e.g. "exit03"), rel_err = ‖y−x‖/‖x‖ over the calls, max_rel_err = max over calls of max|y−x| / max|x|,
calls; plus "monitor_s". SQNR is +∞ for an exact result (written "Infinity"), NaN when a message held NaN. Under
`--monitor-warn-sqnr` (NaN counts as below) a warning on stderr; under `--monitor-min-sqnr` `MonitorError` naming the
site, call and step, after the step's record is written. Tensor-axis sites on data × tensor meshes only (as
`--capture`). Walkthrough: docs/training.md "Fidelity monitor"."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from taco_jax.codec.metrics import db_from_powers
from taco_jax.codec.vma import vma_of
from taco_jax.collectives.megatron import site_collective
from taco_jax.collectives.policy import TENSOR_SITES, CommPolicy
from taco_jax.parallel.mesh import TENSOR
from taco_jax.train import capture
from taco_jax.util.console import say

#: Per-site keys of a monitor record (module docstring).
SITE_KEYS = ("sqnr_db", "min_sqnr_db", "worst_call", "rel_err", "max_rel_err", "calls")


class MonitorError(FloatingPointError):
    """A compressed site's SQNR fell below `--monitor-min-sqnr`. A FloatingPointError so that the
    loop and the CLI treat it as a failed run (exit status 1), as a non-finite loss."""


def monitor_due(step: int, every: int, last: int) -> bool:
    """Whether step `step` (1-based) of a run of `last` steps is monitored with `--monitor-every every`."""
    return every > 0 and (step % every == 0 or step == last)


def monitored_sites(policy: CommPolicy) -> list[str]:
    """The tensor sites `policy` compresses (kind other than "none"), in `TENSOR_SITES` order."""
    return [s for s in TENSOR_SITES if getattr(policy, s).kind != "none"]


def make_monitor_fn(trainer):
    """Jitted (params, inputs, targets) -> (twin loss, {"<site>__<role>": float32 [4]}), the four
    numbers of the module docstring for each message of a compressed tensor site of `trainer.policy`.
    Raises: ValueError for a pipelined trainer (`capture.make_message_fn`)."""
    policy = trainer.policy or trainer.cfg.communication.policy
    sites = set(monitored_sites(policy))
    msg = capture.make_message_fn(trainer)
    picked = [(i, k) for i, k in enumerate(msg.fwd_keys + msg.bwd_keys) if k.split("__")[0] in sites]
    keys = [k for _, k in picked]
    exact = CommPolicy.none()

    def stats(messages):  # inside shard_map: one [1, *message] slot per device
        out = []
        for key, m in zip(keys, messages, strict=True):
            site, m = key.split("__")[0], m[0]
            x = site_collective(m, site, TENSOR, exact).astype(jnp.float32)
            d = site_collective(m, site, TENSOR, policy).astype(jnp.float32) - x
            sums = jnp.stack([jnp.sum(x * x), jnp.sum(d * d)])
            maxes = jnp.stack([jnp.max(jnp.abs(d)), jnp.max(jnp.abs(x))])
            out.append(jnp.concatenate([_over_devices(jax.lax.psum, sums), _over_devices(jax.lax.pmax, maxes)]))
        return out

    smap = jax.shard_map(stats, mesh=trainer.mesh, in_specs=([msg.spec] * len(keys),),
                         out_specs=[P()] * len(keys))

    @jax.jit
    def run(params, inputs, targets):
        loss, fwd, bwd = msg.fn(params, inputs, targets)
        everything = list(fwd) + list(bwd)
        return loss, dict(zip(keys, smap([everything[i] for i, _ in picked]), strict=True))

    return run


def _over_devices(op, v):
    """`op` (psum / pmax) of `v` over the mesh axes it varies over: each distinct value once (a result
    replicated over the tensor axis is not counted once per rank); invariant everywhere after."""
    axes = tuple(sorted(vma_of(v)))
    return op(v, axes) if axes else v


def summarize(per_call: dict) -> dict:
    """{key: [4] stats} (from `make_monitor_fn`) -> {site: {SITE_KEYS...}} (module docstring); the
    sums over a site's calls in float64 on the host."""
    by_site: dict[str, list] = {}
    for key, st in per_call.items():
        site, role = key.split("__")
        by_site.setdefault(site, []).append((role, *(float(v) for v in np.asarray(st, np.float64))))
    out = {}
    for site in [s for s in TENSOR_SITES if s in by_site]:
        calls = by_site[site]
        sig, noise = sum(c[1] for c in calls), sum(c[2] for c in calls)
        per = [(db_from_powers(c[1], c[2]), c[0]) for c in calls]
        worst = min(per, key=lambda v: (not math.isnan(v[0]), v[0]))  # NaN is the worst
        rel = [c[3] / c[4] if c[4] > 0 else (0.0 if c[3] == 0 else math.inf) for c in calls]
        out[site] = {"sqnr_db": db_from_powers(sig, noise), "min_sqnr_db": worst[0], "worst_call": worst[1],
                     "rel_err": math.sqrt(noise / sig) if sig > 0 else (0.0 if noise == 0 else math.inf),
                     "max_rel_err": max(rel, key=lambda v: (math.isnan(v), v)), "calls": len(calls)}
    return out


class Monitor:
    """The monitor of one run: `due(step)`, `measure(step, params, inputs, targets)` before the train
    step (its parameters are donated), `check(step, sites)` after the step's record is written."""

    def __init__(self, trainer, every: int, steps: int, warn_db: float, min_db: float, roles: dict | None = None):
        self.trainer, self.every, self.steps = trainer, every, steps
        self.warn_db, self.min_db = warn_db, min_db
        self.roles = roles or {}
        tp = trainer.mesh.shape.get(TENSOR, 1)  # no tensor axis (or size 1): no message is compressed
        self.sites = monitored_sites(trainer.policy or trainer.cfg.communication.policy) if tp > 1 else []
        self._fn = None

    @classmethod
    def start(cls, cfg, trainer) -> Monitor:
        """Monitor for a `TrainConfig` with `monitor_every > 0`."""
        log = cfg.logging
        return cls(trainer, log.monitor_every, cfg.training.steps, log.monitor_warn_sqnr, log.monitor_min_sqnr,
                   capture.model_roles(cfg))

    def due(self, step: int) -> bool:
        return bool(self.sites) and monitor_due(step, self.every, self.steps)

    def measure(self, step: int, params, inputs, targets) -> dict:
        """{site: {SITE_KEYS...}} of this step's messages (None-free; see `summarize`)."""
        if self._fn is None:
            self._fn = make_monitor_fn(self.trainer)
        _, per_call = self._fn(params, inputs, targets)
        return summarize({k: _host(v) for k, v in per_call.items()})

    def check(self, step: int, sites: dict, where: str = "") -> None:
        """Warns (stderr) for each site whose `min_sqnr_db` is below the warning threshold; raises
        `MonitorError` naming the site, its worst call and the step when below `min_db` (sites in
        ascending SQNR, NaN first, so the error names the worst site)."""
        order = sorted(sites, key=lambda k: (not np.isnan(sites[k]["min_sqnr_db"]), sites[k]["min_sqnr_db"]))
        for site in order:
            st = sites[site]
            v, call = st["min_sqnr_db"], st["worst_call"]
            what = f"{call}, {self.roles[call]}" if call in self.roles else call
            if not v >= self.min_db:
                raise MonitorError(f"step {step}: site {site}: SQNR {v:.2f} dB (worst call {what}) is below "
                                   f"--monitor-min-sqnr {self.min_db:g} dB; the run stopped{where}")
            if not v >= self.warn_db:
                say(f"[taco-jax] monitor: step {step}: site {site}: SQNR {v:.2f} dB (worst call {what}) is below "
                    f"{self.warn_db:g} dB (--monitor-warn-sqnr)")  # the same numbers on every process: once


def _host(x) -> np.ndarray:
    """A replicated output of the monitor as numpy (in a multi-process run: this process's copy)."""
    return np.asarray(x.addressable_data(0))
