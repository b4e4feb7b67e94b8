"""Where a layer's tensor-parallel traffic goes: the tensor axis, the comm policy, sequence parallelism,
and whether the sequence-parallel collectives overlap the matmuls (`tp_overlap`)."""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from taco_jax.codec import NONE
from taco_jax.collectives import CommPolicy, copy_to_tp, gather_from_sp, psum, reduce_from_tp, scatter_to_sp
from taco_jax.collectives.megatron import all_gather_matmul, matmul_reduce_scatter

#: `--tp-overlap`: "none" or "collective-matmul" (the sequence-parallel all-gather / reduce-scatter as
#: P - 1 ring steps interleaved with the matmuls).
TP_OVERLAP = ("none", "collective-matmul")


def check_tp_overlap(tp_overlap: str, sequence_parallel: bool) -> None:
    """Raises ValueError naming a `tp_overlap` not in `TP_OVERLAP`, or an overlap without sequence parallelism."""
    if tp_overlap not in TP_OVERLAP:
        raise ValueError(f"tp_overlap={tp_overlap!r} is not supported; choose one of {TP_OVERLAP}")
    if tp_overlap != "none" and not sequence_parallel:
        raise ValueError(f"tp_overlap={tp_overlap!r} needs sequence parallelism (--sequence-parallel): it splits "
                         "the sequence-parallel all-gather / reduce-scatter into ring steps")


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Static (hashable) description of the tensor-parallel environment a layer runs in.

    Attributes:
      tensor_axis: the `shard_map` axis sharding heads / MLP / vocab, or None (unsharded).
      policy: the codec per communication site (`CommPolicy`).
      sequence_parallel: Megatron sequence parallelism (Korthikanti et al. 2022): activations
        outside the TP blocks are sharded over T (axis 1 of [B, T, D]); f/g become all-gather /
        reduce-scatter.
      tap: None, or a hashable observer with `enter(ctx, x)` / `exit(ctx, x)` (`train/capture.py`).
      tp_overlap: "none" or "collective-matmul" (needs `sequence_parallel`; not with a tap): `enter`
        returns a `PendingGather` and the matmuls run the collectives as rings.
    Raises: ValueError for a `tp_overlap` not in `TP_OVERLAP`, or "collective-matmul" without
      `sequence_parallel`.
    """

    tensor_axis: str | None = None
    policy: CommPolicy = CommPolicy()
    sequence_parallel: bool = False
    tap: object | None = None
    tp_overlap: str = "none"

    def __post_init__(self):
        check_tp_overlap(self.tp_overlap, self.sequence_parallel)

    @property
    def overlapped(self) -> bool:
        """True where `enter` / `exit_matmul` run the collective-matmul rings (tensor axis present, untapped)."""
        return self.tp_overlap != "none" and self.tensor_axis is not None and self.tap is None

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
            return self.tap.enter(dataclasses.replace(self, tap=None, tp_overlap="none"), x)
        if self.overlapped:
            return PendingGather(x, self)
        if self.sequence_parallel:
            return gather_from_sp(x, self.tensor_axis, self.policy, 1)
        return copy_to_tp(x, self.tensor_axis, self.policy)

    def exit(self, x: jax.Array) -> jax.Array:
        """Out of a TP block: "g" (all-reduce fwd / identity bwd) or, with SP, reduce-scatter over T."""
        if self.tensor_axis is None:
            return x
        if self.tap is not None:
            return self.tap.exit(dataclasses.replace(self, tap=None, tp_overlap="none"), x)
        if self.sequence_parallel:
            return scatter_to_sp(x, self.tensor_axis, self.policy, 1)
        return reduce_from_tp(x, self.tensor_axis, self.policy)

    def exit_matmul(self, fn, x: jax.Array) -> jax.Array:
        """`exit(fn(x))` for a RowParallel matmul `fn` of the sequence positions of x [B, T, ...]
        alone; with `overlapped`, the reduce-scatter runs as a ring interleaved with the partial
        matmuls (`matmul_reduce_scatter`)."""
        if self.overlapped:
            return matmul_reduce_scatter(x, fn, self.tensor_axis, self.policy, 1)
        return self.exit(fn(x))

    def psum_exact(self, x: jax.Array) -> jax.Array:
        """Exact FP32 all-reduce over the tensor axis, for small statistics (softmax sums)."""
        return x if self.tensor_axis is None else psum(x, self.tensor_axis, codec=NONE)

    def pmax_exact(self, x: jax.Array) -> jax.Array:
        return x if self.tensor_axis is None else lax.pmax(x, self.tensor_axis)


class PendingGather:
    """The sequence-parallel all-gather of `shard`, not run yet (`ParallelContext.enter` with
    `tp_overlap="collective-matmul"`). The first `apply(fn)` runs the ring with `fn` overlapped and
    keeps the gathered sequence for later calls; reading it as an array (`__jax_array__`) gathers.
    `shape` / `dtype`: the gathered [B, T, D]'s. Holds traced values: use it in its own trace.
    """

    def __init__(self, shard: jax.Array, ctx: ParallelContext):
        self.shard, self.ctx = shard, ctx
        self._gathered = None

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.shard.shape
        return (s[0], s[1] * self.ctx.tp_size, *s[2:])

    @property
    def dtype(self):
        return self.shard.dtype

    @property
    def ndim(self) -> int:
        return self.shard.ndim

    def apply(self, fn) -> jax.Array:
        """fn(the gathered sequence), fn treating the sequence positions (axis 1) independently."""
        if self._gathered is not None:
            return fn(self._gathered)
        y, self._gathered = all_gather_matmul(self.shard, fn, self.ctx.tensor_axis, self.ctx.policy, 1)
        return y

    def gathered(self) -> jax.Array:
        """The whole sequence [B, T, D] (`gather_from_sp`, or the blocks a ring already received)."""
        if self._gathered is None:
            self._gathered = gather_from_sp(self.shard, self.ctx.tensor_axis, self.ctx.policy, 1)
        return self._gathered

    __jax_array__ = gathered
