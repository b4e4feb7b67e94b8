"""Studies of experiments/costmodel/: the cost model of `taco_jax.perf` (index: `experiments`)."""
