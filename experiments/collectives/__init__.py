"""Studies of experiments/collectives/: the compressed collectives (index: `experiments`)."""
