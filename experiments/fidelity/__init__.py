"""Studies of experiments/fidelity/: does compression change training (index: `experiments`)."""
