"""Studies of experiments/step/: one training step (index: `experiments`)."""
