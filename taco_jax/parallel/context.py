"""Where a layer's tensor-parallel traffic goes: the tensor axis, the comm policy, sequence parallelism."""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from taco_jax.codec import NONE
from taco_jax.collectives import CommPolicy, copy_to_tp, gather_from_sp, psum, reduce_from_tp, scatter_to_sp


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Static (hashable) description of the tensor-parallel environment a layer runs in.

    Attributes:
      tensor_axis: the manual mesh axis of the enclosing `shard_map` that shards heads / MLP /
        vocab, or None when running unsharded (single device, or outside `shard_map`).
      policy: the codec per communication site (`CommPolicy`).
      sequence_parallel: Megatron sequence parallelism: activations outside the TP blocks are
        sharded over the sequence axis (axis 1 of [B, T, D]) and the f/g pair becomes
        all-gather / reduce-scatter (Korthikanti et al. 2022).
      tap: optional observer of the TP messages, installed by the caller (`train/capture.py`):
        an object with `enter(ctx, x)` and `exit(ctx, x)` that must return `ctx.enter(x)` /
        `ctx.exit(x)` (same arithmetic) for the untapped `ctx` it is given. Hashable (it is
        part of the model's static graph). None: no observer.
    """

    tensor_axis: str | None = None
    policy: CommPolicy = CommPolicy()
    sequence_parallel: bool = False
    tap: object | None = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tensor_axis is None else lax.axis_size(self.tensor_axis)

    def tp_rank(self) -> jax.Array | int:
        return 0 if self.tensor_axis is None else lax.axis_index(self.tensor_axis)

    def enter(self, x: jax.Array) -> jax.Array:
        """Into a TP block: "f" (identity fwd / all-reduce bwd) or, with SP, all-gather over T."""
        if self.tensor_axis is None:
            return x
        if self.tap is not None:
            return self.tap.enter(dataclasses.replace(self, tap=None), x)
        if self.sequence_parallel:
            return gather_from_sp(x, self.tensor_axis, self.policy, 1)
        return copy_to_tp(x, self.tensor_axis, self.policy)

    def exit(self, x: jax.Array) -> jax.Array:
        """Out of a TP block: "g" (all-reduce fwd / identity bwd) or, with SP, reduce-scatter over T."""
        if self.tensor_axis is None:
            return x
        if self.tap is not None:
            return self.tap.exit(dataclasses.replace(self, tap=None), x)
        if self.sequence_parallel:
            return scatter_to_sp(x, self.tensor_axis, self.policy, 1)
        return reduce_from_tp(x, self.tensor_axis, self.policy)

    def psum_exact(self, x: jax.Array) -> jax.Array:
        """Exact FP32 all-reduce over the tensor axis, for small statistics (softmax sums)."""
        return x if self.tensor_axis is None else psum(x, self.tensor_axis, codec=NONE)

    def pmax_exact(self, x: jax.Array) -> jax.Array:
        return x if self.tensor_axis is None else lax.pmax(x, self.tensor_axis)
