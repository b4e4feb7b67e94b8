"""Capture the real tensor-parallel messages of a training run to `.npz` (`taco-jax train --capture N`).

Mechanism. On each of the N capture steps (evenly spaced, ending at the last step), before the
train step and with its parameters and batch, a jitted twin of the step's loss and gradient runs
in which `ParallelContext.enter` / `exit` hand their messages to a `Tap` (the real steps carry none):

| ctx method | forward message (site)                  | backward message (site)                   |
|------------|-----------------------------------------|-------------------------------------------|
| exit       | x into reduce_from_tp "g" (ar_fwd)      | — (identity)                              |
| enter      | — (identity)                            | cotangent into copy_to_tp "f" (ar_bwd)    |
| exit, SP   | x into scatter_to_sp (reduce_scatter)   | cotangent into its all-gather (all_gather) |
| enter, SP  | x into gather_from_sp (all_gather)      | cotangent into its reduce-scatter (reduce_scatter) |

Forward messages are returned as outputs; backward messages are the gradients of zero "probes" added after each
enter / exit (h + 0): the cotangents the Megatron operators all-reduce. The twin's loss is written next to the real
step's in `meta.json`. (`jax.debug.callback` taps in the real step deadlock on the simulated CPU mesh.)

Kept: every rank of the tensor axis, data-axis rank 0. Data × tensor meshes only (`TrainConfig` refuses pipelined runs).

Files: `<out>/captures/step{S:05d}.npz`, one array per message named `<site>__<role>` (role =
`exit03` / `enter02`: the k-th call of that ctx method in the forward pass), stacked over tensor
ranks `[P, *message]`, float32; `<out>/captures/meta.json` gives model, mesh, steps, losses and,
for GPT, what each role is (`exit01` = "h0.attn": the all-reduce after layer 0's attention)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.parallel.mesh import DATA, TENSOR
from taco_jax.parallel.state import merge_params
from taco_jax.train.step import make_steps
from taco_jax.util import jsonio


@dataclasses.dataclass
class _Collector:
    """Trace-time state of one capture trace: "discover" records probe shapes, "collect" uses probes."""

    mode: str
    probes: list | None = None
    probe_avals: list = dataclasses.field(default_factory=list)
    probe_keys: list = dataclasses.field(default_factory=list)
    fwd: list = dataclasses.field(default_factory=list)
    fwd_keys: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=lambda: {"enter": 0, "exit": 0})

    def role(self, method: str) -> str:
        r = f"{method}{self.counts[method]:02d}"
        self.counts[method] += 1
        return r

    def forward(self, x, key):
        self.fwd.append(x[None])
        self.fwd_keys.append(key)

    def backward(self, h, key):
        """h + probe (zero), so d loss / d probe is the cotangent arriving at h."""
        i = len(self.probe_keys)
        self.probe_keys.append(key)
        if self.mode == "discover":
            self.probe_avals.append(jax.ShapeDtypeStruct(h.shape, h.dtype))
            return h
        return h + self.probes[i][0].astype(h.dtype)


class Tap:
    """The `ParallelContext.tap` of the capture twin: hands each enter / exit message to the active
    collector (see the module table); with none active it is the plain `ctx.enter` / `ctx.exit`.
    Hashable by identity (it sits in the model's static graph)."""

    def __init__(self):
        self.collector: _Collector | None = None

    @contextlib.contextmanager
    def collecting(self, col: _Collector):
        prev, self.collector = self.collector, col
        try:
            yield col
        finally:
            self.collector = prev

    def enter(self, ctx, x: jax.Array) -> jax.Array:
        """`ctx.enter(x)` (ctx untapped), its messages handed to the active collector."""
        col = self.collector
        if col is None:
            return ctx.enter(x)
        role = col.role("enter")
        if ctx.sequence_parallel:
            col.forward(x, f"all_gather__{role}")
            return col.backward(ctx.enter(x), f"reduce_scatter__{role}")
        return col.backward(ctx.enter(x), f"ar_bwd__{role}")

    def exit(self, ctx, x: jax.Array) -> jax.Array:
        """`ctx.exit(x)` (ctx untapped), its messages handed to the active collector."""
        col = self.collector
        if col is None:
            return ctx.exit(x)
        role = col.role("exit")
        if ctx.sequence_parallel:
            col.forward(x, f"reduce_scatter__{role}")
            return col.backward(ctx.exit(x), f"all_gather__{role}")
        col.forward(x, f"ar_fwd__{role}")
        return ctx.exit(x)


# ------------------------------------- the capture twin -------------------------------------


@dataclasses.dataclass(frozen=True)
class MessageFn:
    """The twin (module docstring), traceable: `fn(params, inputs, targets) -> (loss, fwd, bwd)` with
    `fwd[i]` the forward message `fwd_keys[i]` and `bwd[j]` the backward message `bwd_keys[j]`, each
    `[n_devices, *message]` in mesh order, in the model's compute dtype. Call it inside `jax.jit`."""

    fn: callable
    fwd_keys: list
    bwd_keys: list
    spec: P  # PartitionSpec of one message's [n_devices, ...] stack: one slot per device


def make_message_fn(trainer) -> MessageFn:
    """The capture twin of `trainer`'s train step (its mesh, model, specs and resolved policy).
    Raises: ValueError for a pipelined trainer."""
    if getattr(trainer, "staged", None) is not None:
        raise ValueError("capture supports data × tensor meshes without pipeline stages")
    cfg, mesh, abstract_state = trainer.cfg, trainer.mesh, trainer.abstract_state
    tap = Tap()  # the twin's model: the trainer's, with the tap in its ParallelContext
    policy = trainer.policy or cfg.communication.policy  # backends resolved as the real step's
    graphdef = make_steps(cfg.model_config, mesh, policy, sequence_parallel=cfg.parallelism.sequence_parallel,
                          pipelined=False, tap=tap).graphdef
    data_axes = tuple(a for a in (DATA,) if a in mesh.axis_names)
    batch_spec = P(data_axes or None)
    every = P(tuple(mesh.axis_names))  # one slot per device, in mesh order

    def local(params, probes, inputs, targets, col):
        with tap.collecting(col):
            col.probes = probes
            loss = merge_params(graphdef, abstract_state, params).loss(inputs, targets)
        loss = jax.lax.pmean(loss, data_axes) if data_axes else loss
        return loss, col.fwd

    # 1. discover the messages' shapes (trace only)
    disc = _Collector("discover")

    def discover(params, inputs, targets):
        return local(params, None, inputs, targets, disc)[0]

    n_dev = mesh.devices.size
    abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(abstract_state))
    jax.eval_shape(jax.shard_map(discover, mesh=mesh, in_specs=(trainer.specs, batch_spec, batch_spec),
                                 out_specs=P()), abstract_params,
                   *(jax.ShapeDtypeStruct((trainer.cfg.data.batch_size, trainer.cfg.data.seq_len), jnp.int32),) * 2)
    probe_shapes = [jax.ShapeDtypeStruct((n_dev, *a.shape), a.dtype) for a in disc.probe_avals]
    fwd_keys = list(disc.fwd_keys)

    # 2. the twin: loss and d loss / d probes, forward messages as outputs
    def twin(params, probes, inputs, targets):
        col = _Collector("collect")
        loss, fwd = local(params, probes, inputs, targets, col)
        return loss, fwd

    smap = jax.shard_map(twin, mesh=mesh, in_specs=(trainer.specs, [every] * len(probe_shapes), batch_spec, batch_spec),
                         out_specs=(P(), [every] * len(fwd_keys)))
    grad_fn = jax.value_and_grad(smap, argnums=1, has_aux=True)
    probe_sharding = NamedSharding(mesh, every)

    def run(params, inputs, targets):
        probes = [jax.lax.with_sharding_constraint(jnp.zeros(s.shape, s.dtype), probe_sharding) for s in probe_shapes]
        (loss, fwd), bwd = grad_fn(params, probes, inputs, targets)
        return loss, fwd, bwd

    return MessageFn(run, fwd_keys, list(disc.probe_keys), every)


def make_capture_fn(trainer):
    """(params, inputs, targets) -> (loss, {key: [n_devices, *message] float32 numpy}) for `trainer`'s
    model and mesh (`make_message_fn`, jitted). Raises: ValueError for a pipelined trainer."""
    msg = make_message_fn(trainer)
    run = jax.jit(msg.fn)

    def capture_fn(params, inputs, targets):
        loss, fwd, bwd = run(params, inputs, targets)
        out = dict(zip(msg.fwd_keys, fwd))
        out.update(zip(msg.bwd_keys, bwd))
        return float(loss), {k: np.asarray(v, np.float32) for k, v in out.items()}

    return capture_fn


# --------------------------------------- the host side ---------------------------------------


def gpt_roles(n_layer: int) -> dict[str, str]:
    """What each ctx call of `taco_jax.models.GPT` is, in forward order."""
    roles = {"exit00": "embed"}
    for i in range(n_layer):
        roles[f"exit{2 * i + 1:02d}"] = f"h{i}.attn"
        roles[f"exit{2 * i + 2:02d}"] = f"h{i}.mlp"
        roles[f"enter{2 * i:02d}"] = f"h{i}.attn_in"
        roles[f"enter{2 * i + 1:02d}"] = f"h{i}.mlp_in"
    roles[f"enter{2 * n_layer:02d}"] = "lm_head_in"
    return roles


def model_roles(cfg) -> dict[str, str]:
    """`gpt_roles` for a GPT `TrainConfig`, else {} (roles then stay "exitNN" / "enterNN")."""
    n_layer = getattr(cfg.model_config, "n_layer", None)
    return gpt_roles(n_layer) if n_layer and cfg.model.name.startswith("gpt") else {}


def capture_steps(steps: int, n: int) -> list[int]:
    """n steps evenly spaced over 1..steps, ending at the last: round(steps·(i+1)/n)."""
    n = min(n, steps)
    return sorted({max(1, round(steps * (i + 1) / n)) for i in range(n)})


class Recorder:
    """Writes the messages of the chosen steps of one run: per step `capture(step, params, inputs,
    targets)` before the train step (which donates the parameters), `finish_step(step, loss)` after."""

    def __init__(self, trainer, out_dir, steps: list[int], meta: dict):
        self.trainer = trainer
        self.out_dir = pathlib.Path(out_dir)
        self.steps = set(steps)
        self.meta = meta
        self.meta.setdefault("losses", {})
        self.files: list[str] = []
        self._fn = None

    @classmethod
    def start(cls, cfg, out, trainer) -> Recorder:
        """Recorder for a `TrainConfig` with `capture > 0`, writing to `<out>/captures/`."""
        steps = cfg.training.steps
        meta = {"model": cfg.model.name, "mesh": cfg.parallelism.mesh, "comm": cfg.communication.label,
                "sequence_parallel": cfg.parallelism.sequence_parallel,
                "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "steps": steps,
                "captured_steps": capture_steps(steps, cfg.logging.capture), "kept": "all tensor ranks, data rank 0"}
        meta["roles"] = model_roles(cfg)
        rec = cls(trainer, pathlib.Path(out) / "captures", meta["captured_steps"], meta)
        rec.out_dir.mkdir(parents=True, exist_ok=True)
        return rec

    def capture(self, step: int, params, inputs, targets) -> str | None:
        """On a capture step: runs the twin on this step's (params, batch) and writes stepNNNNN.npz."""
        if step not in self.steps:
            return None
        if self._fn is None:
            self._fn = make_capture_fn(self.trainer)
        loss, msgs = self._fn(params, inputs, targets)
        n_t = self.trainer.mesh.shape.get(TENSOR, 1)
        arrays = {k: v[:n_t] for k, v in sorted(msgs.items())}  # data rank 0: the first n_t slots
        path = self.out_dir / f"step{step:05d}.npz"
        np.savez(path, **arrays)
        self.files.append(path.name)
        self.meta["losses"][str(step)] = {"capture_twin": loss}
        self.meta.update(files=self.files, keys=sorted(arrays))
        self._write_meta()
        return str(path)

    def finish_step(self, step: int, loss: float):
        """Records the real train step's loss next to the twin's (capture steps only)."""
        if step in self.steps and str(step) in self.meta["losses"]:
            self.meta["losses"][str(step)]["train_step"] = loss
            self._write_meta()

    def _write_meta(self):
        jsonio.write(self.out_dir / "meta.json", self.meta)

    def close(self) -> dict:
        return {"dir": str(self.out_dir), "files": self.files}


# ------------------------------------------ loading ------------------------------------------


@dataclasses.dataclass
class Message:
    """One captured message: site, role ("exit01"), what it is ("h0.attn"), step, rank, array."""

    site: str
    role: str
    what: str
    step: int
    rank: int
    x: np.ndarray


def load_captures(path) -> tuple[dict, list[Message]]:
    """Reads `<path>/meta.json` and every `step*.npz`; returns (meta, messages, one per rank).
    Raises: ValueError if `path` holds no captures."""
    path = pathlib.Path(path)
    files = sorted(path.glob("step*.npz"))
    if not files or not (path / "meta.json").exists():
        raise ValueError(f"captures={str(path)!r} holds no meta.json and step*.npz files "
                         "(write them with `taco-jax train --capture N --out DIR`; they go to DIR/captures)")
    meta = json.loads((path / "meta.json").read_text())
    roles = meta.get("roles", {})
    out = []
    for f in files:
        step = int(f.stem[4:])
        with np.load(f) as z:
            for key in z.files:
                site, role = key.split("__")
                arr = z[key]
                for r in range(arr.shape[0]):
                    out.append(Message(site, role, roles.get(role, role), step, r, arr[r]))
    return meta, out
