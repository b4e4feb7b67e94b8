"""Studies of experiments/gpu/: the GPU path (index: `experiments`)."""
