"""Tensor-parallel building blocks: context, sharding rules, Megatron layers."""

from taco_jax.parallel.context import ParallelContext
from taco_jax.parallel.layers import (
    ColumnParallel,
    RowParallel,
    VocabParallelEmbed,
    residual_std,
    vocab_parallel_cross_entropy,
)
from taco_jax.parallel.rules import LOGICAL_AXIS_RULES, logical_to_spec, param_specs

__all__ = ["LOGICAL_AXIS_RULES", "ColumnParallel", "ParallelContext", "RowParallel", "VocabParallelEmbed",
           "logical_to_spec", "param_specs", "residual_std", "vocab_parallel_cross_entropy"]
