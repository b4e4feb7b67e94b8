"""Studies of experiments/codec/: the codec alone and its share of a step (index: `experiments`)."""
