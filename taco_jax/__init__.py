"""taco_jax: FP8 compression of tensor-parallel communication (TACO, arXiv 2604.24088) in JAX."""

__version__ = "0.1.0"
