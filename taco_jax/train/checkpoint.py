"""Checkpoints of a training run with Orbax (`orbax.checkpoint.CheckpointManager`).

Layout (`<out>/checkpoints/`, docs/distributed.md):
    <step>/state/   parameters and optimizer state (Orbax PyTree, OCDBT + zarr; each process writes
                    its own shards, restored onto any mesh through the target's shardings)
    <step>/meta/    JSON: step, data position and RNG state, run config with the communication
                    policy, parameter shapes, per-leaf fingerprints, process count
    <step>.orbax-checkpoint-tmp-*   a save in progress (or interrupted): never read

A save runs in the background (async: the step loop continues while the arrays are written) and
is atomic: Orbax writes into a temporary folder and renames it to `<step>` only when every process
finished, so a crash during a save leaves the previous checkpoints untouched and no `<step>` that
looks complete; old checkpoints beyond `keep` are removed only after a newer one is complete.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp

FORMAT = 1  # bump when the meta layout changes
#: Run-config fields that must match to resume (the model's structure and its tokenizer).
STRUCTURAL = ("model", "vocab_size")
#: Fields that change the numbers of the continued run (reported, not refused).
NUMERIC = ("seed", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip",
           "steps", "microbatches", "schedule", "sequence_parallel")
_RTOL = 1e-4  # fingerprints: float32 sums of |x| reduced in a mesh-dependent order


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _paths(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@jax.jit
def _fingerprints(tree):
    """Per leaf: float32 sum of |x| (a corrupt or truncated restore shows up as a different sum)."""
    return jax.tree.map(lambda a: jnp.sum(jnp.abs(a.astype(jnp.float32))), tree)


def _mesh_shardings(tree):
    """Shardings of `tree`'s leaves, a leaf that is not on the mesh (e.g. the optimizer's step count,
    a constant of `tx.init`, lives on one device) given the mesh's replicated sharding."""
    from jax.sharding import NamedSharding, PartitionSpec

    leaves = jax.tree.leaves(tree)
    mesh = next((a.sharding.mesh for a in leaves if isinstance(a.sharding, NamedSharding)), None)
    if mesh is None:
        return jax.tree.map(lambda a: a.sharding, tree)
    return jax.tree.map(lambda a: a.sharding if isinstance(a.sharding, NamedSharding)
                        else NamedSharding(mesh, PartitionSpec()), tree)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here (another model or vocabulary, corrupt, truncated)."""


class Checkpoints:
    """The checkpoints of one run in `directory` (every process constructs it; Orbax coordinates).

    keep: how many of the newest complete checkpoints to keep (older ones are deleted after a
    newer one completes). `async_save`: write in a background thread.
    """

    def __init__(self, directory, *, keep: int, async_save: bool = True):
        ocp = _ocp()
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (temporary folders of unfinished saves excluded), ascending."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict, *, wait: bool = False) -> None:
        """Starts saving (params, opt_state) and `meta` (JSON-ready) as checkpoint `step`; returns once
        the arrays are copied off the devices (the files are written in the background) or, with
        `wait`, when the checkpoint is complete. Every process must call it with the same step."""
        ocp = _ocp()
        state = {"params": params, "opt_state": opt_state}
        state = jax.device_put(state, _mesh_shardings(state))  # one mesh for every leaf (a no-op after a step)
        fp = {k: float(v) for k, v in _paths(jax.device_get(_fingerprints(state))).items()}
        shapes = {k: [list(v.shape), str(v.dtype)] for k, v in _paths(state).items()}
        meta = {"format": FORMAT, "step": step, "processes": jax.process_count(), "shapes": shapes,
                "fingerprints": fp, **meta}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Blocks until a background save completed (raises its error, if any)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def read_meta(self, step: int) -> dict:
        """The JSON meta of checkpoint `step`. Raises CheckpointError when it is missing or unreadable."""
        ocp = _ocp()
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            why = " ".join(str(e).split())[:300]
            raise CheckpointError(f"checkpoint {self.directory / str(step)}: its meta cannot be read "
                                  f"({type(e).__name__}: {why}); corrupt or truncated") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {self.directory / str(step)}: meta format "
                                  f"{meta.get('format') if isinstance(meta, dict) else meta!r}, expected {FORMAT}")
        return meta

    def check(self, step: int, config: dict, params, opt_state) -> dict:
        """The meta of checkpoint `step` after checking that it can be restored into arrays shaped like
        `params` / `opt_state` of a run with `config` (`TrainConfig.to_dict()`); reads no array.
        Raises CheckpointError naming what differs (model, vocab_size, a parameter's shape) or an
        unreadable meta."""
        where = self.directory / str(step)
        meta = self.read_meta(step)
        saved = meta.get("config", {})
        for f in STRUCTURAL:
            if saved.get(f) != config.get(f):
                began = saved.get("init_from") or ""
                source = (f" (the run started from init_from={began!r}; give --init-from {began})"
                          if began and f == "model" and config.get("init_from") != began else "")
                raise CheckpointError(f"checkpoint {where} is of {f}={saved.get(f)!r}, this run has "
                                      f"{f}={config.get(f)!r}{source}; resume with the same {f} or another --out")
        state = {"params": params, "opt_state": opt_state}
        want = {k: [list(v.shape), str(v.dtype)] for k, v in _paths(state).items()}
        have = meta.get("shapes", {})
        diff = [f"{k}: checkpoint {have.get(k)} vs this run {want.get(k)}"
                for k in sorted(set(want) | set(have)) if have.get(k) != want.get(k)]
        if diff:
            raise CheckpointError(f"checkpoint {where} does not match this run's parameters / optimizer state "
                                  f"({len(diff)} differ; e.g. {'; '.join(diff[:3])})")
        return meta

    def restore(self, step: int, config: dict, params, opt_state, *, shardings=None) -> tuple:
        """Checkpoint `step` placed like `params` / `opt_state` (this run's arrays: their shapes and
        dtypes, and their shardings unless `shardings` = (params', opt_state') shardings is given; a
        checkpoint saved on another mesh is resharded by Orbax).

        config: this run's `TrainConfig.to_dict()`.
        Returns (params, opt_state, meta, notes): notes name run-config fields that differ from the
        checkpoint's but do not prevent resuming (e.g. lr). Raises CheckpointError as `check`, or
        for a corrupt / truncated checkpoint (unreadable arrays, or arrays that differ from the
        fingerprints saved with them).
        """
        ocp = _ocp()
        where = self.directory / str(step)
        meta = self.check(step, config, params, opt_state)
        saved = meta.get("config", {})
        state = {"params": params, "opt_state": opt_state}
        shardings = _mesh_shardings(state) if shardings is None else \
            {"params": shardings[0], "opt_state": shardings[1]}
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
            jax.block_until_ready(out)
        except Exception as e:
            why = " ".join(str(e).split())  # one line
            raise CheckpointError(f"checkpoint {where}: its arrays cannot be read ({type(e).__name__}: "
                                  f"{why[:300]}); corrupt or truncated") from e
        got = {k: float(v) for k, v in _paths(jax.device_get(_fingerprints(out))).items()}
        bad = [k for k, v in meta.get("fingerprints", {}).items() if not _same(got.get(k, math.nan), v)]
        if bad:
            raise CheckpointError(f"checkpoint {where}: {len(bad)} arrays differ from what was saved (e.g. {bad[0]}: "
                                  f"sum |x| {got.get(bad[0])!r} vs {meta['fingerprints'][bad[0]]!r}); corrupt")
        notes = [f"{f}: checkpoint {saved.get(f)!r}, now {config.get(f)!r}" for f in NUMERIC
                 if f in saved and saved.get(f) != config.get(f)]
        if saved.get("init_from", "") != config.get("init_from", ""):  # same architecture (checked), other folder
            notes.append(f"init_from: checkpoint {saved.get('init_from')!r}, now {config.get('init_from')!r}")
        if saved.get("mesh") != config.get("mesh"):
            notes.append(f"mesh: checkpoint {saved.get('mesh')!r}, now {config.get('mesh')!r} (resharded)")
        return out["params"], out["opt_state"], meta, notes

def _same(a: float, b: float) -> bool:
    """Fingerprints agree: equal (NaN with NaN too) or within `_RTOL`."""
    return math.isclose(a, b, rel_tol=_RTOL) or (math.isnan(a) and math.isnan(b))
