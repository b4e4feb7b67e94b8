"""Model state on a mesh, and the jitted train / eval steps (loss and gradients inside `shard_map`, AdamW outside).

Inside one `shard_map` over the mesh (data, stage, tensor) each data shard differentiates its own loss (scaled by 1
/ data size), the pipeline runs over the stage axis (`parallel/pipeline.py`), and the gradients are summed over the
data axis in float32 (`collectives/dp.py`, codec `CommPolicy.dp_grads`). With `dp_grads` exact this equals
differentiating the mean loss from outside to float rounding (~1e-7 relative; tests/test_3d.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax import perf
from taco_jax.collectives import CommPolicy
from taco_jax.collectives.dp import sync_gradients, vary
from taco_jax.models import decays, make_model
from taco_jax.parallel import ParallelContext, param_specs
from taco_jax.parallel import pipeline as pp
from taco_jax.parallel.mesh import DATA, STAGE, TENSOR, make_mesh
from taco_jax.parallel.state import merge_params, sharded_initializer
from taco_jax.train.config import TrainConfig
from taco_jax.train.distributed import emulated_link, tensor_link_bytes_per_s
from taco_jax.util.console import say


@dataclasses.dataclass
class Trainer:
    """Everything a run needs: mesh, parameter specs, optimizer, and the two jitted steps
    `train_step(params, opt_state, inputs, targets) -> (params, opt_state, metrics)` and
    `eval_step(params, inputs, targets) -> mean loss`; inputs/targets: int32 [B, T] global. With
    `staged` set the parameters are in pipeline layout (`staged.unstack_layers` undoes it)."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    abstract_state: nnx.State
    specs: dict
    tx: optax.GradientTransformation
    train_step: callable
    eval_step: callable
    staged: pp.StagedModel | None = None
    policy: CommPolicy | None = None  # cfg.communication.policy with concrete backends (what the step runs)

    def init(self):
        """Initial (params, opt_state), each device computing only its own shards; the same values for
        any --comm and mesh. With `cfg.model.init_from`: read from that HF checkpoint
        (`models.hf.load_params`); otherwise the values of the eager `make_model(cfg.model_config,
        rngs=nnx.Rngs(cfg.training.seed))` bit for bit (`parallel.state.sharded_initializer`)."""
        if self.cfg.model.init_from:
            from taco_jax.models.hf import load_params

            params = load_params(self.cfg.model.init_from, self.cfg.model_config, shardings=self.shardings,
                                 stacked_key=self.staged.layer_key if self.staged else None)
        else:
            leaves, treedef = jax.tree.flatten(self.shardings)
            params = _initializer(self.cfg.model_config, self.cfg.training.seed, self.staged is not None, tuple(leaves),
                                  treedef)()
        return params, jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)

    @property
    def shardings(self):
        """`NamedSharding`s of the parameters (pytree like them; pipeline layout when `staged`)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs)

    @property
    def opt_shardings(self):
        """`NamedSharding`s of the optimizer state (`tx.init`'s tree): each tree of moments like the
        parameters (`shardings`), every other leaf (the step counts) replicated over the mesh."""
        params = jax.eval_shape(functools.partial(_fresh_params, self.cfg.model_config, self.cfg.training.seed,
                                                  self.staged is not None))
        abstract = jax.eval_shape(self.tx.init, params)
        replicated = NamedSharding(self.mesh, P())
        return optax.tree.map_params(self.tx, lambda _, s: s, abstract, self.shardings,
                                     transform_non_params=lambda _: replicated)

    def compiled_hlo(self, params, opt_state, inputs, targets) -> str:
        """Optimized HLO text of the train step (for wire-byte accounting and HLO tests)."""
        return self.train_step.lower(params, opt_state, inputs, targets).compile().as_text()


def _fresh_params(model_cfg, seed: int, pipelined: bool) -> dict:
    """`make_model(model_cfg, rngs=nnx.Rngs(seed))`'s parameters as a pure dict (pipeline layout when
    `pipelined`: `StagedModel.stack_layers`)."""
    model = make_model(model_cfg, rngs=nnx.Rngs(seed))
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
    return pp.StagedModel.from_model(model).stack_layers(params) if pipelined else params


@functools.lru_cache(maxsize=8)
def _initializer(model_cfg, seed: int, pipelined: bool, shardings: tuple, treedef):
    """The compiled sharded initialisation of `_fresh_params` (shardings: the flattened leaves)."""
    return sharded_initializer(functools.partial(_fresh_params, model_cfg, seed, pipelined),
                               jax.tree.unflatten(treedef, shardings))


def compiled_memory(compiled) -> dict | None:
    """Per-device memory of a compiled step in bytes (XLA `memory_analysis()`): `temp` (activations,
    what `--remat` lowers), `argument`, `output`, `alias`, `generated_code`; None without analysis."""
    try:
        mem = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):  # backends without an analysis
        return None
    if mem is None:
        return None
    return {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output", "alias",
                                                                   "generated_code")}


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Learning rate of the update with optax step count c = 0, 1, ... (training step k = c + 1).

    Linear warmup lr · k / W for k = 1..W (step 1 already moves the parameters; the peak first applies at step W),
    then cosine decay from lr at step W to exactly lr · min_lr_ratio at the last step (`cfg.training.steps`). With W
    = 0 the first step runs at the peak. Source: nanoGPT `get_lr` / GPT-NeoX, which index the schedule by the step
    being taken (the off-by-one of `optax.warmup_cosine_decay_schedule(0, ...)`, whose step 1 runs at lr 0)."""
    t = cfg.training
    peak, floor, w, n = t.lr, t.lr * t.min_lr_ratio, t.warmup, t.steps
    start = max(w, 1)  # the step the cosine starts at (the peak)

    def schedule(count):
        k = jnp.asarray(count, jnp.float32) + 1.0
        warm = peak * k / max(w, 1)
        progress = jnp.clip((k - start) / max(n - start, 1), 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(k <= w, warm, cosine)

    return schedule


def make_optimizer(cfg: TrainConfig, decay_mask=None) -> optax.GradientTransformation:
    """AdamW (β1, β2 = `cfg.training.adam_b1`, `adam_b2`) with `lr_schedule` and global-norm clipping
    (nanoGPT recipe). decay_mask: pytree of bools, or params -> pytree of bools; default: by role
    (`taco_jax.models.decays`: kernels and embeddings decayed, biases and norm scales never)."""
    if decay_mask is None:
        decay_mask = role_decay_mask
    return optax.chain(
        optax.clip_by_global_norm(cfg.training.grad_clip),
        optax.adamw(lr_schedule(cfg), b1=cfg.training.adam_b1, b2=cfg.training.adam_b2,
                    weight_decay=cfg.training.weight_decay, mask=decay_mask),
    )


def role_decay_mask(params):
    """Pytree of bools like `params` (pure dict, model or pipeline layout): True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


@dataclasses.dataclass(frozen=True, eq=False)
class Steps:
    """The sharded `value_and_grad(params, inputs, targets) -> (mean loss, gradients)` and
    `loss(params, inputs, targets) -> mean loss` of a model (what `make_trainer` jits): global arrays
    in and out. `specs`: PartitionSpecs of the parameters (pipeline layout when `staged` is set)."""

    value_and_grad: callable
    loss: callable
    graphdef: nnx.GraphDef
    abstract_state: nnx.State
    specs: dict
    staged: pp.StagedModel | None


def make_steps(model_cfg, mesh, policy, *, sequence_parallel: bool = False, microbatches: int = 1,
               schedule: str = "gpipe", pipelined: bool | None = None, tap=None, tp_overlap: str = "none") -> Steps:
    """Loss and gradient of `model_cfg` (GPT or Qwen config) over `mesh` (axes data / stage / tensor). `pipelined`:
    run the pipeline schedules (default: `pp.pipelined_layout`); `tap`: observer of the TP messages given to
    `ParallelContext` (`train/capture.py`); `tp_overlap`: `ParallelContext.tp_overlap`."""
    tensor_axis = TENSOR if TENSOR in mesh.axis_names else None
    stage_axis = STAGE if STAGE in mesh.axis_names else None
    data_axis = DATA if DATA in mesh.axis_names else None
    n_data = mesh.shape[data_axis] if data_axis else 1
    ctx = ParallelContext(tensor_axis=tensor_axis, policy=policy, sequence_parallel=sequence_parallel, tap=tap,
                          tp_overlap=tp_overlap)
    abstract = nnx.eval_shape(lambda: make_model(model_cfg, ctx, rngs=nnx.Rngs(0),
                                                 tensor_size=mesh.shape.get(TENSOR, 1)))
    graphdef, abstract_state = nnx.split(abstract, nnx.Param)
    if pipelined is None:
        pipelined = pp.pipelined_layout(mesh.shape.get(STAGE, 1), microbatches)
    staged = pp.StagedModel.from_model(abstract) if pipelined else None
    specs = staged.specs(mesh.axis_names) if staged else param_specs(abstract_state, mesh.axis_names)
    batch_spec = P(data_axis)

    def local_loss(params, inputs, targets):  # this data shard's mean loss (eval; no gradient)
        if staged:
            return pp.gpipe_loss(staged, params, inputs, targets, microbatches=microbatches, stage_axis=stage_axis,
                                 policy=policy)
        return merge_params(graphdef, abstract_state, params).loss(inputs, targets)

    def local_value_and_grad(params, inputs, targets):  # per device, inside shard_map
        params = jax.tree.map(lambda p: vary(p, (data_axis,)), params)  # 1. per-shard gradients
        if staged:  # 2. the pipeline schedule over the stage axis
            loss, grads = pp.value_and_grad(staged, params, inputs, targets, schedule=schedule,
                                            microbatches=microbatches, stage_axis=stage_axis, policy=policy,
                                            loss_scale=1.0 / n_data)
        else:
            def scaled(p):  # loss / n_data: the cotangent the transpose of pmean would give
                loss = merge_params(graphdef, abstract_state, p).loss(inputs, targets)
                return loss / n_data, loss

            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        grads = sync_gradients(grads, data_axis, policy)  # 3. sum over data shards in FP32 (dp_grads codec)
        return _mean_over(loss, data_axis), grads

    loss_fn = jax.shard_map(lambda *a: _mean_over(local_loss(*a), data_axis), mesh=mesh,
                            in_specs=(specs, batch_spec, batch_spec), out_specs=P())
    value_and_grad = jax.shard_map(local_value_and_grad, mesh=mesh, in_specs=(specs, batch_spec, batch_spec),
                                   out_specs=(P(), specs))
    return Steps(value_and_grad, loss_fn, graphdef, abstract_state, specs, staged)


def make_trainer(cfg: TrainConfig, devices=None) -> Trainer:
    """Builds the mesh, model definition, specs and jitted steps for `cfg` (validated already).
    devices: the mesh's devices (default: all). Raises: ValueError (`make_mesh`) for a mesh that does
    not match the device count."""
    par, comm = cfg.parallelism, cfg.communication
    mesh = make_mesh(par.axes, devices)
    policy = comm.policy.resolve_backends(n_devices=mesh.devices.size,  # concrete backends, before tracing
                                          transport=comm.transport)
    policy = perf.resolve_min_bytes(policy, mesh.devices.flat[0].platform, tensor_size=par.axes.get(TENSOR, 1),
                                    itemsize=jnp.dtype(cfg.model_config.dtype).itemsize,
                                    sequence_parallel=par.sequence_parallel,  # min_bytes "auto"
                                    link_bytes_per_s=tensor_link_bytes_per_s(emulated_link(comm.emulated_link)))
    if comm.policy.min_bytes == "auto":
        say(f"taco-jax: --min-bytes auto -> {policy.min_bytes} bytes (the cost model's break-even size on "
            f"{mesh.devices.flat[0].platform}, docs/cost_model.md): smaller messages run the exact collective; "
            "the compiled step's wire bytes in summary.json show what was compressed")
    steps = make_steps(cfg.model_config, mesh, policy, sequence_parallel=par.sequence_parallel,
                       microbatches=par.microbatches, schedule=par.schedule, tp_overlap=par.tp_overlap)
    tx = make_optimizer(cfg, _decay_mask(steps.abstract_state, steps.staged))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, inputs, targets):
        loss, grads = steps.value_and_grad(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    eval_step = jax.jit(steps.loss)
    return Trainer(cfg, mesh, steps.graphdef, steps.abstract_state, steps.specs, tx, train_step, eval_step,
                   steps.staged, policy)


def _mean_over(x, axis):
    return jax.lax.pmean(x, axis) if axis else x


def _decay_mask(abstract_state, staged):
    """Weight-decay mask by role (`role_decay_mask`) of the model's parameters, in the layout the
    trainer holds them (pipeline layout when `staged`: the stacked layers keep their names)."""
    mask = role_decay_mask(nnx.to_pure_dict(abstract_state))
    if staged is not None:
        mask = {**mask, staged.layer_key: mask[staged.layer_key][0]}
    return mask


def shard_batch(trainer: Trainer, *arrays):
    """Puts host int32 [B, T] arrays on the mesh, split over the data axis."""
    axes = tuple(a for a in (DATA,) if a in trainer.mesh.axis_names)
    sharding = NamedSharding(trainer.mesh, P(axes or None))
    return tuple(jax.device_put(jnp.asarray(a), sharding) for a in arrays)
