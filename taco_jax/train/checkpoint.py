"""Checkpoints of a training run with Orbax (`orbax.checkpoint.CheckpointManager`).

Layout (`<out>/checkpoints/`, docs/distributed.md):
    <step>/state/   parameters and optimizer state (Orbax PyTree, OCDBT + zarr; each process writes
                    its own shards, restored onto any mesh through the target's shardings)
    <step>/meta/    JSON: step, data position and RNG state, run config with the communication
                    policy, parameter shapes, per-leaf fingerprints, process count
    <step>.orbax-checkpoint-tmp*    a save in progress (or interrupted): never read
    <step>.corrupt                  a corrupt checkpoint set aside by `Checkpoints.resume` (kept, never read)

A save is asynchronous and atomic (Orbax renames its temporary folder to `<step>` once every process finished; older
checkpoints beyond `keep` go only after that). `Checkpoints.resume` takes the newest checkpoint that restores."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from taco_jax.collectives.policy import SITES, CommPolicy
from taco_jax.testing import faults

FORMAT = 1  # bump when the meta layout changes
#: Run-config fields that must match to resume (the model's structure and its tokenizer).
STRUCTURAL = ("model", "vocab_size")
#: Fields that change the numbers of the continued run (reported, not refused).
NUMERIC = ("seed", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip",
           "adam_b1", "adam_b2", "steps", "microbatches", "schedule", "sequence_parallel")
#: Fields of NUMERIC that set the learning-rate schedule (`train.step.lr_schedule`): a resume that
#: changes one says that the schedule is recomputed.
SCHEDULE = ("lr", "min_lr_ratio", "warmup_steps", "steps")
_RTOL = 1e-4  # fingerprints: float32 sums of |x| reduced in a mesh-dependent order


def _policy_change(saved, now) -> str:
    """The communication settings that differ between a checkpoint's config (`saved["policy"]`) and
    this run's, as "sites codec -> codec; key value -> value" (sites with the same change grouped), or
    "" when they are the same or the checkpoint records no policy."""
    if not isinstance(saved, dict) or not isinstance(now, dict) or saved == now:
        return ""
    try:
        a, b = CommPolicy.from_dict(saved, where="checkpoint policy"), CommPolicy.from_dict(now)
    except ValueError:  # a policy this version cannot read: say only that it differs
        return "another policy -> this run's"
    groups: dict[tuple[str, str], list[str]] = {}
    for site in SITES:
        if getattr(a, site) != getattr(b, site):
            groups.setdefault((getattr(a, site).name, getattr(b, site).name), []).append(site)
    parts = [f"{'/'.join(sites)} {x} -> {y}" for (x, y), sites in groups.items()]
    parts += [f"{f.name} {getattr(a, f.name)} -> {getattr(b, f.name)}" for f in dataclasses.fields(a)
              if f.name not in SITES and getattr(a, f.name) != getattr(b, f.name)]
    return "; ".join(parts)


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
    """Shardings of `tree`'s leaves, a leaf that is not on the mesh (an array made outside
    `Trainer.init` and the train step, e.g. on one device) given the mesh's replicated sharding."""
    from jax.sharding import NamedSharding, PartitionSpec

    leaves = jax.tree.leaves(tree)
    mesh = next((a.sharding.mesh for a in leaves if isinstance(a.sharding, NamedSharding)), None)
    if mesh is None:
        return jax.tree.map(lambda a: a.sharding, tree)
    return jax.tree.map(lambda a: a.sharding if isinstance(a.sharding, NamedSharding)
                        else NamedSharding(mesh, PartitionSpec()), tree)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here (another model or vocabulary, corrupt, truncated)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files cannot be read back as saved (truncated, flipped bytes, missing meta)."""


def _why(e: Exception) -> str:
    """A short line of a restore error: the array TensorStore names and the innermost reason of its
    chain; JSON specs, status codes, file paths and the driver chain dropped."""
    text = " ".join(str(e).split())
    text = re.sub(r"\s*\[tensorstore_spec(\[\d+\])?='.*?'\]", "", text)
    while re.search(r"<[^<>]*>", text):  # reprs of Python objects (a bound method, a pybind11 function), nested
        text = re.sub(r"\s*<[^<>]*>", "", text)
    text = re.sub(r"^[A-Z_]+: ", "", text)
    for marker in ("tensorstore_spec", "pybind11"):  # an unterminated spec or a bare repr: cut before it
        if marker in text:
            text = text[:text.index(marker)].rstrip(" [(<'\"=,;:") + " ..."
    array = re.search(r'Error reading "([^"/]+)/\.z\w+"', text)
    reason = text.rsplit('": ', 1)[-1]  # after the last quoted name (a file, a driver): the cause
    reason = reason if len(reason) <= 200 else reason[:197] + "..."
    return f"{array[1]}: {reason}" if array else reason


def _state_handler():
    """Orbax's `StandardCheckpointHandler`, in a one-process run without replica-parallel saving
    (which compiles a slicing program per shard shape on the first save and gains nothing in one
    process). Same files; its own type-handler registry (Orbax's global one is left as it is)."""
    ocp = _ocp()
    handler = ocp.StandardCheckpointHandler()
    if jax.process_count() > 1:
        return handler
    from orbax.checkpoint._src.metadata import array_metadata_store

    th = ocp.type_handlers
    types = th.create_type_handler_registry(
        *((t, th.ScalarHandler()) for t in (int, float, bytes, np.number)), (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())),
        (str, th.StringHandler()))
    # StandardCheckpointHandler's own PyTree handler (its concurrency limits), with `types`: it takes no registry
    handler._impl = ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, restore_concurrent_gb=96,
                                                type_handler_registry=types)
    return handler


class Checkpoints:
    """The checkpoints of one run in `directory` (every process constructs it; Orbax coordinates).
    keep: how many of the newest complete checkpoints to keep. async_save: write in a background thread."""

    def __init__(self, directory, *, keep: int, async_save: bool = True):
        ocp = _ocp()
        self.directory = pathlib.Path(directory).absolute()
        # create=False: the folder appears with the first save (none for a run that never checkpoints)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=False)
        meta = faults.meta_handler() or ocp.JsonCheckpointHandler()  # a test's slowed save, else Orbax's
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, handler, args in (("state", _state_handler(), (ocp.args.StandardSave, ocp.args.StandardRestore)),
                                    ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore))):
            for a in args:
                registry.add(item, a, handler)
        self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)

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
        state = jax.device_put(state, _mesh_shardings(state))  # one mesh for every leaf (a no-op for the run's state)
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
            raise CorruptCheckpointError(f"checkpoint {self.directory / str(step)}: its meta cannot be read "
                                         f"({_why(e)}); corrupt or truncated") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {self.directory / str(step)}: meta format "
                                  f"{meta.get('format') if isinstance(meta, dict) else meta!r}, expected {FORMAT}")
        return meta

    def check(self, step: int, config: dict, params, opt_state, *, vocab: tuple[int, int] | None = None) -> dict:
        """The meta of checkpoint `step` after checking, without reading an array, that it restores
        into arrays shaped like `params` / `opt_state` of a run with `config` (`TrainConfig.to_dict()`).

        vocab: this run's (real rows, padded rows): a leaf differing only in the padded vocabulary
        axis is accepted (`restore` trims or pads the zero rows). None: shapes must match.
        Raises CheckpointError naming what differs; CorruptCheckpointError for an unreadable meta."""
        where = self.directory / str(step)
        meta = self.read_meta(step)
        saved, config = _flags(meta.get("config", {})), _flags(config)
        for f in STRUCTURAL:
            if saved.get(f) != config.get(f):
                began = saved.get("init_from") or ""
                source = (f" (the run started from init_from={began!r}; give --init-from {began})"
                          if began and f == "model" and not _same_folder(config.get("init_from"), began) else "")
                raise CheckpointError(f"checkpoint {where} is of {f}={saved.get(f)!r}, this run has "
                                      f"{f}={config.get(f)!r}{source}; resume with the same {f} or another --out")
        state = {"params": params, "opt_state": opt_state}
        want = {k: [list(v.shape), str(v.dtype)] for k, v in _paths(state).items()}
        have = meta.get("shapes", {})
        pads = _padding_axes(have, want, _saved_padded_vocab(saved, vocab), vocab)
        keys = sorted(set(want) | set(have), key=lambda k: (not k.startswith("['params']"), k))  # parameters first
        diff = [f"{k}: checkpoint {have.get(k, 'has no such array')} vs this run {want.get(k, 'has no such array')}"
                for k in keys if have.get(k) != want.get(k) and k not in pads]
        if diff:
            layouts = {name: _pipelined(flags) for name, flags in (("checkpoint", saved), ("this run", config))}
            hint = ""
            if None not in layouts.values() and len(set(layouts.values())) == 2:
                lay = {k: "pipelined (stage > 1 or microbatches > 1)" if v else "unpipelined"
                       for k, v in layouts.items()}
                hint = (f"; the checkpoint's layout is {lay['checkpoint']}, this run's {lay['this run']}: they "
                        "store the decoder layers differently, resume with the saving run's stage / microbatches "
                        "or another --out")
            raise CheckpointError(f"checkpoint {where} does not match this run's parameters / optimizer state "
                                  f"({len(diff)} differ; e.g. {'; '.join(diff[:3])}){hint}")
        return meta

    def restore(self, step: int, config: dict, params, opt_state, *, shardings=None,
                vocab: tuple[int, int] | None = None) -> tuple:
        """Checkpoint `step` with the shapes, dtypes and shardings of `params` / `opt_state` (or of
        `shardings` = (params', opt_state') shardings); another mesh's checkpoint is resharded.

        config, vocab: as `check`; vocabulary padding rows are trimmed (they must be zero) or zero-padded.
        Returns (params, opt_state, meta, notes): notes name what differs without preventing the resume.
        Raises CheckpointError as `check`, or naming a leaf whose trimmed rows are not zero;
        CorruptCheckpointError for unreadable arrays or arrays that differ from their fingerprints."""
        ocp = _ocp()
        where = self.directory / str(step)
        meta = self.check(step, config, params, opt_state, vocab=vocab)
        saved, config = _flags(meta.get("config", {})), _flags(config)
        state = {"params": params, "opt_state": opt_state}
        shardings = _mesh_shardings(state) if shardings is None else \
            {"params": shardings[0], "opt_state": shardings[1]}
        pads = _padding_axes(meta.get("shapes", {}), {k: [list(v.shape), str(v.dtype)] for k, v in
                                                      _paths(state).items()}, _saved_padded_vocab(saved, vocab), vocab)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        if pads:  # read at the saved shape (sharded as the target where it divides, else replicated); re-padded below
            target = _map_paths(target, lambda k, t: t if k not in pads else jax.ShapeDtypeStruct(
                tuple(meta["shapes"][k][0]), t.dtype, sharding=_for_shape(t.sharding, meta["shapes"][k][0])))
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
            jax.block_until_ready(out)
        except Exception as e:
            raise CorruptCheckpointError(f"checkpoint {where}: its arrays cannot be read ({_why(e)}); "
                                         "corrupt or truncated") from None
        got = {k: float(v) for k, v in _paths(jax.device_get(_fingerprints(out))).items()}
        bad = [k for k, v in meta.get("fingerprints", {}).items() if not _same(got.get(k, math.nan), v)]
        if bad:
            raise CorruptCheckpointError(f"checkpoint {where}: {len(bad)} arrays differ from what was saved (e.g. "
                                         f"{bad[0]}: sum |x| {got.get(bad[0])!r} vs {meta['fingerprints'][bad[0]]!r}); "
                                         "corrupt")
        notes = [f"{f}: checkpoint {saved.get(f)!r}, now {config.get(f)!r}" for f in NUMERIC
                 if f in saved and saved.get(f) != config.get(f)]
        if any(f in saved and saved.get(f) != config.get(f) for f in SCHEDULE):
            notes.append(f"the learning-rate schedule is recomputed for steps={config.get('steps')!r} (warmup and "
                         "cosine): from here on it differs from the checkpointed run's")
        if not _same_folder(saved.get("init_from"), config.get("init_from")):  # same architecture, other folder
            notes.append(f"init_from: checkpoint {saved.get('init_from')!r}, now {config.get('init_from')!r}")
        if saved.get("mesh") != config.get("mesh"):
            notes.append(f"mesh: checkpoint {saved.get('mesh')!r}, now {config.get('mesh')!r} (resharded)")
        if change := _policy_change(saved.get("policy"), config.get("policy")):
            notes.append(f"communication (checkpoint -> now): {change}")
        if pads:
            keys, targets = list(_paths(state)), list(_paths(shardings).values())  # leaf order of `out` too
            leaves = [a if k not in pads else _repad(a, pads[k], vocab, target=t, name=k, where=where)
                      for k, t, a in zip(keys, targets, jax.tree.leaves(out), strict=True)]
            out = jax.tree.unflatten(jax.tree.structure(out), leaves)
            notes.append(f"vocabulary padding: checkpoint {_saved_padded_vocab(saved, vocab)} rows, now {vocab[1]} "
                         f"(zero rows {'trimmed' if vocab[1] < _saved_padded_vocab(saved, vocab) else 'added'}; "
                         f"{len(pads)} arrays)")
        return out["params"], out["opt_state"], meta, notes

    def resume(self, config: dict, params, opt_state, *, shardings=None, vocab: tuple[int, int] | None = None,
               fallback: bool = True, arrays: bool = True):
        """The newest checkpoint that restores (`restore`; with `arrays` False only `check`ed).
        Returns None when there is none, else (step, params, opt_state, meta, notes, warnings)
        (params etc. None without `arrays`; warnings name the corrupt checkpoints skipped).

        With `fallback`, corrupt newer checkpoints are skipped and, once one restored, renamed to `<step>.corrupt`
        (never deleted: this run's save of that step would collide with it); without, CorruptCheckpointError names
        the newest intact one. Raises CorruptCheckpointError when all are corrupt; CheckpointError as `check`."""
        bad = []
        for step in reversed(self.steps()):
            try:
                if arrays:
                    p, o, meta, notes = self.restore(step, config, params, opt_state, shardings=shardings,
                                                     vocab=vocab)
                else:
                    p, o, meta, notes = None, None, self.check(step, config, params, opt_state, vocab=vocab), []
            except CorruptCheckpointError as e:
                bad.append((step, str(e)))
                continue
            if bad and not fallback:
                raise CorruptCheckpointError(
                    f"{bad[0][1]}. The newest intact checkpoint is {self.directory / str(step)} (step {step}); "
                    f"resume from it with --resume-fallback (the corrupt {'ones are' if len(bad) > 1 else 'one is'} "
                    f"then renamed to <step>.corrupt, nothing is deleted)")
            if arrays:
                warnings = [f"{msg}; resumed from the newest intact checkpoint, step {step}, instead "
                            f"(the corrupt one renamed to {self._set_aside(s)})" for s, msg in bad]
            else:
                warnings = [f"{msg}; step {step} is intact" for _, msg in bad]
            return step, p, o, meta, notes, warnings
        if bad:
            raise CorruptCheckpointError(f"no intact checkpoint in {self.directory}: " + "; ".join(m for _, m in bad)
                                         + "; start afresh with another --out")
        return None

    def _set_aside(self, step: int) -> pathlib.Path:
        """Renames corrupt checkpoint `step` to `<step>.corrupt` (`.corrupt-2`, ... if taken), which Orbax
        does not list; process 0 renames, every process waits for it. Returns the new path."""
        from jax.experimental import multihost_utils

        def barrier(what):
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"taco_jax checkpoint {step} {what}")

        barrier("to set aside")  # every process picks the same free name before process 0 renames
        src, n = self.directory / str(step), 1
        dst = self.directory / f"{step}.corrupt"
        while dst.exists():
            n += 1
            dst = self.directory / f"{step}.corrupt-{n}"
        barrier("named")
        if jax.process_index() == 0:
            src.rename(dst)
        barrier("set aside")
        self.manager.reload()
        return dst


def saved_steps(directory) -> list[int]:
    """Steps of the complete checkpoints in `directory`, ascending, from the folder names without
    Orbax; [] when it does not exist."""
    d = pathlib.Path(directory)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _flags(config: dict) -> dict:
    """{flag: value} of a recorded run config (`TrainConfig.to_dict()`, or flat as older runs wrote it)."""
    from taco_jax.train.config import flag_values

    return flag_values(config, "checkpoint config")


def _pipelined(flags: dict) -> bool | None:
    """Whether a run of these flags (`_flags`) steps in the pipeline layout (`ParallelismSection.pipelined`);
    None when its mesh or microbatches are not recorded or not readable."""
    from taco_jax.train.config import ParallelismSection

    try:
        return ParallelismSection(mesh=flags["mesh"], microbatches=int(flags["microbatches"])).pipelined
    except (KeyError, TypeError, ValueError):  # no hint
        return None


def _saved_padded_vocab(saved: dict, vocab: tuple[int, int] | None) -> int | None:
    """Padded vocabulary rows of the run that saved (its config: make_vocab_size_divisible_by × tensor
    size), for this run's real vocabulary `vocab[0]`; None without `vocab` or those fields."""
    from taco_jax.parallel.mesh import TENSOR, parse_mesh

    if vocab is None or "mesh" not in saved or "make_vocab_size_divisible_by" not in saved:
        return None
    multiple = int(saved["make_vocab_size_divisible_by"]) * parse_mesh(saved["mesh"]).get(TENSOR, 1)
    return -(-vocab[0] // multiple) * multiple


def _padding_axes(have: dict, want: dict, saved_rows: int | None, vocab: tuple[int, int] | None) -> dict:
    """{leaf: axis} of the leaves that differ only in their vocabulary padding: one axis, `saved_rows`
    in the checkpoint (`have`) vs `vocab[1]` in this run (`want`), the same dtype."""
    if vocab is None or saved_rows is None or saved_rows == vocab[1]:
        return {}
    out = {}
    for k, (shape, dtype) in want.items():
        if k not in have or have[k][1] != dtype or len(have[k][0]) != len(shape):
            continue
        axes = [i for i, (a, b) in enumerate(zip(have[k][0], shape)) if a != b]
        if len(axes) == 1 and have[k][0][axes[0]] == saved_rows and shape[axes[0]] == vocab[1]:
            out[k] = axes[0]
    return out


def _map_paths(tree, fn):
    """`fn(keystr, leaf)` over a pytree's leaves."""
    return jax.tree_util.tree_map_with_path(lambda path, a: fn(jax.tree_util.keystr(path), a), tree)


def _for_shape(sharding, shape):
    """`sharding` for an array of `shape` when each axis divides evenly into its shards, else the
    mesh's replicated sharding."""
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        sharding.shard_shape(tuple(shape))
        return sharding
    except ValueError:
        return NamedSharding(sharding.mesh, PartitionSpec())


def _repad(a, axis: int, vocab: tuple[int, int], *, target, name: str, where):
    """`a` with its vocabulary `axis` trimmed or zero-padded to `vocab[1]` rows, placed on `target`.
    Raises CheckpointError naming the leaf when a trimmed row is not zero (not padding)."""
    rows = a.shape[axis]
    if rows > vocab[1]:
        tail = jax.lax.slice_in_dim(a, vocab[1], rows, axis=axis)
        if bool(jnp.any(tail != 0)):
            raise CheckpointError(f"checkpoint {where}: {name} has non-zero rows in [{vocab[1]}, {rows}) of its "
                                  f"vocabulary axis; they are not padding, so the checkpoint's {rows} rows cannot "
                                  f"become this run's {vocab[1]} (real vocabulary {vocab[0]})")
        a = jax.lax.slice_in_dim(a, 0, vocab[1], axis=axis)
    else:
        a = jnp.pad(a, [(0, vocab[1] - rows if i == axis else 0) for i in range(a.ndim)])
    return jax.device_put(a, target)


def _same_folder(a: str | None, b: str | None) -> bool:
    """Whether two recorded folders are the same: config.json records them absolute; a relative
    one (recorded by an older run) is taken against the current folder."""
    return (a or "") == (b or "") or bool(a and b and os.path.abspath(a) == os.path.abspath(b))


def _same(a: float, b: float) -> bool:
    """Fingerprints agree: equal (NaN with NaN too) or within `_RTOL`."""
    return math.isclose(a, b, rel_tol=_RTOL) or (math.isnan(a) and math.isnan(b))
