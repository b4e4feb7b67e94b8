"""Model state on a mesh, and the jitted train / eval steps (loss inside `shard_map`, AdamW outside)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.models import GPT
from taco_jax.parallel import ParallelContext, param_specs
from taco_jax.parallel.mesh import make_mesh
from taco_jax.train.config import TrainConfig


@dataclasses.dataclass
class Trainer:
    """Everything a run needs: mesh, parameter specs, optimizer, and the two jitted steps.

    `train_step(params, opt_state, inputs, targets) -> (params, opt_state, metrics)`;
    `eval_step(params, inputs, targets) -> mean loss`. inputs/targets: int32 [B, T] global.
    """

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    abstract_state: nnx.State
    specs: dict
    tx: optax.GradientTransformation
    train_step: callable
    eval_step: callable

    def init(self):
        """Initial (params, opt_state), sharded over the mesh; same values for any --comm."""
        model = GPT(self.cfg.model_config, rngs=nnx.Rngs(self.cfg.seed))
        params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
        params = jax.device_put(params, self.shardings)
        opt_state = jax.jit(self.tx.init)(params)
        return params, opt_state

    @property
    def shardings(self):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs)

    def compiled_hlo(self, params, opt_state, inputs, targets) -> str:
        """Optimized HLO text of the train step (for wire-byte accounting and HLO tests)."""
        return self.train_step.lower(params, opt_state, inputs, targets).compile().as_text()


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (β2 = 0.95) with linear warmup + cosine decay and global-norm clipping (nanoGPT recipe)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def make_trainer(cfg: TrainConfig) -> Trainer:
    """Builds the mesh, model definition, specs and jitted steps for `cfg` (validated already).

    Raises: ValueError (from `make_mesh`) if the mesh does not match the device count.
    """
    mesh = make_mesh(cfg.mesh_axes)
    tensor_axis = "tensor" if "tensor" in mesh.axis_names else None
    data_axes = tuple(a for a in ("data",) if a in mesh.axis_names)
    ctx = ParallelContext(tensor_axis=tensor_axis, policy=cfg.policy, sequence_parallel=cfg.sequence_parallel)
    abstract = nnx.eval_shape(lambda: GPT(cfg.model_config, ctx, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract, nnx.Param)
    specs = param_specs(abstract_state, mesh.axis_names)
    batch_spec = P(data_axes or None)

    def local_loss(params, inputs, targets):  # runs per device inside shard_map
        state = jax.tree.map(lambda v: v, abstract_state)  # fresh State to fill in
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(graphdef, state)
        loss = model.loss(inputs, targets)
        return jax.lax.pmean(loss, data_axes) if data_axes else loss

    loss_fn = jax.shard_map(local_loss, mesh=mesh, in_specs=(specs, batch_spec, batch_spec), out_specs=P())
    tx = make_optimizer(cfg)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    eval_step = jax.jit(loss_fn)
    return Trainer(cfg, mesh, graphdef, abstract_state, specs, tx, train_step, eval_step)


def shard_batch(trainer: Trainer, *arrays):
    """Puts host int32 [B, T] arrays on the mesh, split over the data axis."""
    axes = tuple(a for a in ("data",) if a in trainer.mesh.axis_names)
    sharding = NamedSharding(trainer.mesh, P(axes or None))
    return tuple(jax.device_put(jnp.asarray(a), sharding) for a in arrays)
