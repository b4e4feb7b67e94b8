"""Compressed collectives (all-reduce, all-gather, reduce-scatter, ppermute) and Megatron f/g operators."""

from taco_jax.collectives.compressed import all_gather, ppermute, psum, psum_scatter
from taco_jax.collectives.megatron import copy_to_tp, gather_from_sp, reduce_from_tp, scatter_to_sp
from taco_jax.collectives.policy import SITES, TENSOR_SITES, CommPolicy

__all__ = ["SITES", "TENSOR_SITES", "CommPolicy", "all_gather", "copy_to_tp", "gather_from_sp",
           "ppermute", "psum", "psum_scatter", "reduce_from_tp", "scatter_to_sp"]
